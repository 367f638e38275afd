"""GET /api/v1/nodes/ shows each node once per change (issue 35.2; accelerators.api.node_list_page):
a page read again with nothing changed reads no device, and after each kind of change — a
session placed and ended, a fractional setting, a heartbeat, a node's sharing settings, a
drain — its answer is the one the list gives with nothing kept (read inside a transaction,
where nothing is kept), on PostgreSQL where the kept cluster view tells what changed."""

from __future__ import annotations

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.renderers import JSONRenderer

from accelerators.models import FractionalSettings, Node
from tests.conftest import client_for
from tests.seed import gpu_cluster

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the kept cluster view is PostgreSQL's"),
]

NODES = "/api/v1/nodes/?limit=3"


@pytest.fixture
def api(alice):
    from accelerators.cluster_view import cluster_view

    cluster_view().forget()
    return client_for(alice)


def listed(api) -> tuple[dict, list[str]]:
    """The page as served (in autocommit, kept per change) and the SQL it ran."""
    with CaptureQueriesContext(connection) as queries:
        response = api.get(NODES)
    assert response.status_code == 200, response.content[:300]
    return response.json(), [q["sql"] for q in queries.captured_queries]


def unkept(api) -> dict:
    """The page as the list shows it with nothing kept."""
    with transaction.atomic():
        response = api.get(NODES)
    assert response.status_code == 200
    return response.json()


def reads_devices(sql: list[str]) -> bool:
    return any('FROM "accelerators_device"' in s for s in sql)


def test_a_page_read_again_unchanged_reads_no_device_and_each_change_shows_at_once(api, alice, staff):
    from sessions.admission.launch import session_create
    from sessions.lifecycle.services import session_report_apply
    from sessions.scheduling.scheduler import schedule_pending

    gpu_cluster(nodes=4, gpus=2)
    first, sql = listed(api)
    assert reads_devices(sql) and first == unkept(api) and len(first["results"]) == 3
    again, sql = listed(api)
    assert again == first and not reads_devices(sql)

    session = session_create(owner=alice, name="s0", resources={"cuda.shares": "1.5", "mem": "64M"})
    schedule_pending()
    placed, sql = listed(api)
    assert placed == unkept(api) and reads_devices(sql)
    allocated = [d["allocated_fgpu"] for n in placed["results"] for d in n["devices"] if d["allocated_fgpu"] != "0.00"]
    assert allocated == ["1.50"]

    session_report_apply(session_id=str(session.pk), status="TERMINATED", reason="done", exit_code=0)
    ended, _ = listed(api)
    assert ended == unkept(api) == first

    FractionalSettings.objects.filter(slot_name="cuda").update(unit_mem=2 << 30)  # not in the change log
    halved, _ = listed(api)
    assert halved == unkept(api) and halved["results"][0]["devices"][0]["capacity_fgpu"] == "2.00"
    assert first["results"][0]["devices"][0]["capacity_fgpu"] == "2.00"  # 8 GiB / 4 GiB and 80 / 40 SMs before
    FractionalSettings.objects.filter(slot_name="cuda").update(unit_proc=20)
    doubled, _ = listed(api)
    assert doubled == unkept(api) and doubled["results"][0]["devices"][0]["capacity_fgpu"] == "4.00"

    Node.objects.filter(name="gpu-node-0").update(last_heartbeat=timezone.now())  # a heartbeat: not in the change log
    beat, sql = listed(api)
    assert beat == unkept(api) and not reads_devices(sql)
    assert beat["results"][0]["last_heartbeat"] != doubled["results"][0]["last_heartbeat"]

    staff_api = client_for(staff)
    etag = staff_api.get("/api/v1/nodes/gpu-node-1/")["ETag"]
    scaling = {"memory_scaling": "1.50", "core_scaling": "1.50"}
    assert staff_api.patch("/api/v1/nodes/gpu-node-1/", scaling, format="json", HTTP_IF_MATCH=etag).status_code == 200
    scaled, _ = listed(api)
    assert scaled == unkept(api) and scaled["results"][1]["memory_scaling"] == "1.50"
    assert [r["devices"][0]["capacity_fgpu"] for r in (beat["results"][1], scaled["results"][1])] == ["4.00", "6.00"]

    assert staff_api.post("/api/v1/nodes/gpu-node-2/drain/", {"reason": "driver upgrade"}, format="json").status_code == 200
    drained, _ = listed(api)
    assert drained == unkept(api) and drained["results"][2]["drain"]["reason"] == "driver upgrade"
    Node.objects.filter(name="gpu-node-2").update(drain_reason="new driver")  # not in the change log either
    assert listed(api)[0]["results"][2]["drain"]["reason"] == "new driver" == unkept(api)["results"][2]["drain"]["reason"]


def test_the_pages_etag_comes_from_its_nodes_digests_and_changes_with_any_node_on_the_page(api):
    gpu_cluster(nodes=4, gpus=2)
    first = api.get(NODES)
    tag, names = first["ETag"], [n["name"] for n in first.json()["results"]]
    with transaction.atomic():
        assert api.get(NODES)["ETag"] == tag  # the same page shown with nothing kept: the same tag
    again = api.get(NODES, HTTP_IF_NONE_MATCH=tag)
    assert (again.status_code, again.content, again["ETag"]) == (304, b"", tag)
    kept = api.get(NODES)  # written from the kept nodes' JSON (NodeListRenderer): DRF's bytes
    assert kept.content == first.content == JSONRenderer().render(first.json()) and kept["ETag"] == tag

    (off_page,) = Node.objects.exclude(name__in=names).values_list("name", flat=True)
    Node.objects.filter(name=off_page).update(last_heartbeat=timezone.now())
    assert api.get(NODES, HTTP_IF_NONE_MATCH=tag).status_code == 304  # not on the page: the same body

    Node.objects.filter(name=names[1]).update(last_heartbeat=timezone.now())  # not in the change log
    beat = api.get(NODES, HTTP_IF_NONE_MATCH=tag)
    assert beat.status_code == 200 and beat["ETag"] != tag
    with transaction.atomic():
        assert api.get(NODES)["ETag"] == beat["ETag"]

    second_page = api.get(NODES + "&offset=3")  # another page (next, previous, results): another tag
    assert second_page.status_code == 200 and second_page["ETag"] not in (tag, beat["ETag"])


def test_a_deleted_nodes_kept_dict_is_dropped_so_what_is_kept_stays_one_per_node(api):
    """What the list keeps per node (accelerators.api._SHOWN) follows the cluster: a node deleted,
    or added and deleted again, leaves nothing behind at the next page read, so the process keeps
    at most one entry per node however many come and go."""
    from accelerators import api as node_api

    gpu_cluster(nodes=4, gpus=1)

    def kept_after_listing() -> set[str]:
        assert api.get("/api/v1/nodes/?limit=1000").status_code == 200
        return {str(pk) for pk in node_api._SHOWN}

    def live() -> set[str]:
        return {str(pk) for pk in Node.objects.values_list("pk", flat=True)}

    assert kept_after_listing() == live() and len(live()) == 4  # an earlier test's nodes are gone too
    for n in range(6):  # nodes come and go: one added, one deleted, each round
        gpu_cluster(nodes=1, gpus=1, prefix=f"passing-{n}")
        (oldest,) = Node.objects.order_by("registered_at", "name").values_list("pk", flat=True)[:1]
        assert kept_after_listing() == live()
        Node.objects.filter(pk=oldest).delete()
        kept = kept_after_listing()
        assert str(oldest) not in kept and kept == live()
        assert len(node_api._SHOWN) == 4
