"""The fleet overview (issue 36.4) against the real database: `GET /api/v1/fleet/` (administrators
only) counts fGPU, whole and MIG GPUs, node states, usage samples; its filters, sort and pages;
its query count does not grow with the fleet; the admin's page and the node list's capacity
columns; "My resources" counts MIG capacity."""
from __future__ import annotations

import time

import pytest

from accelerators.fleet import fleet_overview, node_fleet_state, profile_compute_slices
from accelerators.models import Device, MigMode, Node, NodeStatus, ResourceGroup
from tests.conftest import GiB, client_for, make_cluster, mock_gpu
from usage.models import DeviceSample

pytestmark = pytest.mark.django_db


def h100(index: int, node: int):
    return mock_gpu(index, node=node, memory=80 * GiB, sms=132, model="H100-80GB")


@pytest.fixture
def fleet(django_capture_on_commit_callbacks):
    """Nodes a and b (two 8 GiB GPUs each, 2 fGPU a GPU; b in group "training"), c (one, LOST)
    and the dynamic-MIG node m (one H100), with `fgpu_sessions` 0.5-fGPU sessions of `owner`'s
    placed on a or b and `mig_sessions` 1g.10gb sessions on m (launched through the API; the
    scheduler's pass runs as each launch commits)."""

    def build(*, mig_sessions: int = 2, fgpu_sessions: int = 1, owner) -> None:
        make_cluster(nodes={"a": [mock_gpu(0), mock_gpu(1)], "b": [mock_gpu(0, node=1), mock_gpu(1, node=1)],
                            "c": [mock_gpu(0, node=2)], "m": [h100(0, node=3)]})
        Node.objects.filter(name="m").update(mig_mode=MigMode.DYNAMIC)
        Node.objects.filter(name="b").update(resource_group=ResourceGroup.objects.create(name="training"))
        Node.objects.filter(name="c").update(status=NodeStatus.LOST)
        client = client_for(owner)
        launches = [{"cuda.shares": "0.5"}] * fgpu_sessions + [{"mig_profile": "1g.10gb"}] * mig_sessions
        for i, resources in enumerate(launches):
            with django_capture_on_commit_callbacks(execute=True):
                response = client.post("/api/v1/sessions/", {"name": f"s{i}", "resources": resources}, format="json")
            assert response.status_code == 201, response.content

    return build


def test_the_overview_counts_fgpu_whole_and_mig_gpus_and_each_nodes_state(fleet, alice, staff):
    fleet(owner=alice)

    body = client_for(staff).get("/api/v1/fleet/").json()

    assert body["states"] == {"ready": 3, "draining": 0, "mig-pending": 0, "mig-error": 0, "lost": 1}
    assert body["groups"] == ["training"] and body["models"] == ["CUDA GPU", "H100-80GB"]
    totals = body["totals"]
    assert (totals["nodes"], totals["gpus"], totals["mig_gpus"]) == (4, 6, 1)
    assert (totals["fgpu_capacity"], totals["fgpu_free"], totals["fgpu_allocated"]) == ("10.00", "9.50", "0.50")
    assert (totals["mig_total"], totals["mig_free"], totals["gpus_idle"]) == (7, 5, 4)
    by_name = {n["name"]: n for n in body["nodes"]}
    assert [n["name"] for n in body["nodes"]] == ["a", "b", "c", "m"] and body["count"] == 4
    assert by_name["c"]["state"] == "lost" and by_name["b"]["resource_group"] == "training"
    [gpu] = by_name["m"]["gpus"]
    assert (gpu["kind"], gpu["mig_total"], gpu["mig_used"], gpu["load"]) == ("mig", 7, 2, 28)
    assert gpu["capacity_fgpu"] is None and gpu["free_fgpu"] is None
    held = [g for n in (by_name["a"], by_name["b"]) for g in n["gpus"] if g["sessions"]]
    assert [(g["kind"], g["allocated_fgpu"], g["free_fgpu"], g["capacity_fgpu"], g["load"]) for g in held] == [
        ("fgpu", "0.50", "1.50", "2.00", 25)]
    assert held[0]["memory_allocated"] == 2 * GiB and held[0]["used"] is None  # no sample: unknown, not idle
    assert {h["name"]: h["load"] for h in body["heat"]} == {"a": by_name["a"]["load"], "b": by_name["b"]["load"],
                                                            "c": 0, "m": 28}


def test_used_comes_from_each_gpus_newest_sample_of_the_last_two_minutes(fleet, alice, staff):
    fleet(owner=alice, mig_sessions=0, fgpu_sessions=0)
    gpu = Device.objects.get(node__name="a", index=0)
    now = int(time.time())
    DeviceSample.objects.create(device=gpu, t=now - 20, memory_used=1 * GiB, memory_total=8 * GiB, util=10)
    DeviceSample.objects.create(device=gpu, t=now - 5, memory_used=3 * GiB, memory_total=8 * GiB, util=50)
    stale = Device.objects.get(node__name="a", index=1)
    DeviceSample.objects.create(device=stale, t=now - 600, memory_used=5 * GiB, memory_total=8 * GiB, util=90)

    body = client_for(staff).get("/api/v1/fleet/?name=a").json()

    [node] = body["nodes"]
    assert node["gpus"][0]["used"] == {"memory_used": 3 * GiB, "util": 50, "t": now - 5}
    assert node["gpus"][1]["used"] is None
    assert body["used"] == {"gpus_sampled": 1, "memory_used": 2 * GiB, "util": 30}  # the mean over its 2 samples


@pytest.mark.parametrize("query, names", [
    ("state=lost", ["c"]),
    ("state=ready&sort=-load", ["m", "a", "b"]),
    ("resource_group=training", ["b"]),
    ("resource_group=-", ["a", "c", "m"]),
    ("model=h100", ["m"]),
    ("min_free_mig=5", ["m"]),
    ("min_free_mig=6", []),
    ("min_free_fgpu=4", ["b"]),
    ("min_idle_gpus=2", ["b"]),
    ("sort=free", ["b", "a", "c", "m"]),
    ("name=A", ["a"]),
])
def test_the_filters_keep_the_nodes_they_name(fleet, alice, staff, query, names):
    fleet(owner=alice)  # the 0.5-fGPU session goes to a (first by name under fgd-plus on equal nodes)
    body = client_for(staff).get(f"/api/v1/fleet/?{query}").json()
    assert [n["name"] for n in body["nodes"]] == names
    assert [h["name"] for h in body["heat"]] == names and body["count"] == len(names)
    assert sum(body["states"].values()) == 4  # the whole fleet, whatever the filters


def test_pages_hold_page_size_nodes_and_a_page_past_the_last_gives_the_last(alice, staff):
    make_cluster(nodes={f"n{i:02d}": [mock_gpu(0, node=i)] for i in range(7)})
    client = client_for(staff)
    body = client.get("/api/v1/fleet/?page_size=3&page=2").json()
    assert ([n["name"] for n in body["nodes"]], body["page"], body["pages"], body["count"]) == (["n03", "n04", "n05"], 2, 3, 7)
    assert len(body["heat"]) == 7
    body = client.get("/api/v1/fleet/?page_size=3&page=99").json()
    assert ([n["name"] for n in body["nodes"]], body["page"]) == (["n06"], 3)


@pytest.mark.parametrize("query, field", [
    ("state=drained", "state"), ("state=", "state"), ("page=0", "page"), ("page_size=201", "page_size"), ("min_free_fgpu=-1", "min_free_fgpu"),
    ("min_idle_gpus=x", "min_idle_gpus"), ("sort=random", "sort"),
])
def test_a_bad_parameter_is_a_400_naming_it(staff, query, field):
    response = client_for(staff).get(f"/api/v1/fleet/?{query}")
    assert response.status_code == 400 and field in response.json()["field_errors"]


def test_only_administrators_see_the_fleet(alice):
    assert client_for(alice).get("/api/v1/fleet/").status_code == 403
    assert client_for(None).get("/api/v1/fleet/").status_code in (401, 403)


def test_the_overview_reads_the_same_number_of_queries_for_3_and_30_nodes(django_assert_max_num_queries):
    def count() -> int:
        from django.db import connection
        from django.test.utils import CaptureQueriesContext

        with CaptureQueriesContext(connection) as queries:
            fleet_overview()
        return len(queries)

    make_cluster(nodes={f"n{i:02d}": [mock_gpu(0, node=i), mock_gpu(1, node=i)] for i in range(3)})
    few = count()
    make_cluster(nodes={f"n{i:02d}": [mock_gpu(0, node=i), mock_gpu(1, node=i)] for i in range(3, 30)})
    assert count() == few <= 8


def test_profile_compute_slices_reads_nvidias_names():
    assert [profile_compute_slices(p) for p in ("1g.10gb", "3g.40gb", "1g.20gb+me", "7g.80gb", "", "x")] == [1, 3, 1, 7, 0, 0]


def test_the_admin_fleet_page_and_the_node_list_show_capacity(fleet, alice, admin, client):
    fleet(owner=alice)
    client.force_login(admin)
    page = client.get("/admin/accelerators/node/fleet/")
    assert page.status_code == 200
    html = page.content.decode()
    assert 'data-api="/api/v1/fleet/"' in html and "js/fleet.js" in html and '<option value="training"' in html
    assert '<option value="H100" selected>' in client.get("/admin/accelerators/node/fleet/?model=H100").content.decode()
    listing = client.get("/admin/accelerators/node/").content.decode()
    assert "Fleet overview" in listing and "Free fGPU" in listing and "Free MIG slices" in listing
    assert "5 / 7" in listing  # m's free MIG compute slices
    assert "3.50 / 4.00" in listing and "4.00 / 4.00" in listing  # a and b free fGPU


def test_a_non_staff_user_gets_no_fleet_page(alice, client):
    client.force_login(alice)
    assert client.get("/admin/accelerators/node/fleet/").status_code == 302  # to the admin's login


def test_a_nodes_state_is_lost_before_draining_before_its_mig_sync():
    assert node_fleet_state(status=NodeStatus.LOST, mig_sync={"state": "error"}, draining=True) == "lost"
    assert node_fleet_state(status=NodeStatus.ALIVE, mig_sync={"state": "error"}, draining=True) == "draining"
    assert [node_fleet_state(status=NodeStatus.ALIVE, mig_sync={"state": s}) for s in ("error", "sent", "applied", "")] == [
        "mig-error", "mig-pending", "ready", "ready"]


def test_a_drained_node_is_draining_and_the_state_filter_finds_it(fleet, alice, staff):
    from accelerators.drain import node_drain

    fleet(owner=alice, mig_sessions=0)
    node_drain(node_name="b", reason="new cables", by="root")
    body = client_for(staff).get("/api/v1/fleet/?state=draining").json()
    assert [n["name"] for n in body["nodes"]] == ["b"] and body["states"]["draining"] == 1
