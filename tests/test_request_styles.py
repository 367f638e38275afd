"""Every request style of the GPU-sharing systems, from the REST body to the allocator's grants.

Table-driven: the issue's worked examples for Backend.AI's strategies, HAMi's memory + cores
(its resource names included), Run:ai fractions, eGPU settings, pinning and NUMA, through
`parse_resources` + `place` (pure) and through `POST /api/v1/sessions/` and `/preview/`.
"""
from __future__ import annotations

from decimal import Decimal as D

import pytest
from rest_framework.test import APIClient

from accelerators.allocation.core import DeviceState, FractionalSettings, place
from accelerators.allocation.errors import InsufficientResource, InvalidResourceRequest, NeverSchedulable
from accelerators.allocation.requests import parse_resources
from tests.builders import gpu_in_fgpu, node
from tests.conftest import make_cluster, mock_gpu

GiB = 1 << 30
MiB = 1 << 20
Q25 = FractionalSettings(unit_mem=4 * GiB, unit_proc=40, quantum=D("0.25"))
Q01 = FractionalSettings(unit_mem=4 * GiB, unit_proc=40, quantum=D("0.01"))


def shares_of(placement):
    return [g.shares for g in placement.grants]


@pytest.mark.parametrize(("frees", "body", "settings", "expected"), [
    ([D(1), D(1)], {"cuda.shares": "1.5"}, Q25, [D("0.75"), D("0.75")]),
    ([D(1), D(1)], {"cuda.shares": "1.5", "strategy": "fill"}, Q25, [D("1.00"), D("0.50")]),
    ([D("0.8"), D("0.75"), D("0.7"), D("0.3"), D(0)], {"cuda.shares": "2.31"}, Q01,
     [D("0.67"), D("0.67"), D("0.67"), D("0.30")]),
])
def test_the_issue_s_worked_fgpu_examples_split_exactly_as_written(frees, body, settings, expected):
    devices = [gpu_in_fgpu(i, free=f, total=D(1)) for i, f in enumerate(frees)]
    placement = place([node("n1", *devices)], parse_resources(body), settings)
    assert sorted(shares_of(placement), reverse=True) == sorted(expected, reverse=True)
    assert sum(shares_of(placement)) == D(body["cuda.shares"])


def test_when_only_0_65_is_free_in_all_0_66_is_refused_and_nothing_is_granted():
    frees = [D("0.05"), D("0.1"), D("0.2"), D("0.3"), D(0)]
    nodes = [node("n1", *(gpu_in_fgpu(i, free=f, total=D(1)) for i, f in enumerate(frees)))]
    with pytest.raises(InsufficientResource, match="0.66 fGPU requested, 0.65 fGPU free"):
        place(nodes, parse_resources({"cuda.shares": "0.66"}), Q01)


@pytest.mark.parametrize(("body", "memory", "procs"), [
    ({"gpu": 1, "gpu_memory": "4G", "gpu_cores": 60}, 4 * GiB, D(48)),
    ({"gpu": 1, "gpu_memory": "4096M", "gpu_cores": 60}, 4 * GiB, D(48)),
    ({"gpu": 1, "gpu_memory": 4 * GiB}, 4 * GiB, D(0)),
    ({"gpu": 1, "gpu_memory_percentage": 25}, 2 * GiB, D(0)),
    ({"gpu_fraction": "0.2"}, int(D(8 * GiB) * D("0.2")), D(16)),
    ({"nvidia.com/gpu": 1, "nvidia.com/gpumem": 3000, "nvidia.com/gpucores": 30}, 3000 * MiB, D(24)),
    ({"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 50}, 4 * GiB, D(0)),
    ({"nvidia.com/gpu": 1}, 8 * GiB, D(0)),
    ({"egpu": {"GPU_MEM_PER_DEVICE": 2 * GiB, "GPU_UTIL_PER_DEVICE": 50}}, 2 * GiB, D(40)),
    ({"egpu": {"ALIYUN_COM_GPU_MEM_CONTAINER": 2, "ALIYUN_COM_GPU_MEM_DEV": 8}}, 2 * GiB - 10 * MiB, D(0)),
    ({"egpu": {"ALIYUN_COM_GPU_MEM_CONTAINER": 2, "ALIYUN_COM_GPU_MEM_RESERVED": 0}}, 2 * GiB, D(0)),
    ({"egpu": {"GPU_MEM_PER_DEVICE": GiB, "GPU_UTIL_PER_DEVICE": 96}}, GiB, D(0)),
])
def test_each_per_device_style_gives_one_device_that_memory_and_that_share_of_its_sms(body, memory, procs):
    [grant] = place([node("n1", gpu_in_fgpu(0))], parse_resources(body), Q25).grants
    assert (grant.memory, grant.procs) == (memory, procs)


def test_gpu_count_takes_distinct_devices_each_with_the_full_per_device_amount():
    placement = place([node("n1", gpu_in_fgpu(0), gpu_in_fgpu(1), gpu_in_fgpu(2))],
                      parse_resources({"gpu": 2, "gpu_memory": "4G", "gpu_cores": 60}), Q25)
    assert len({g.device_id for g in placement.grants}) == 2
    assert all((g.memory, g.procs) == (4 * GiB, D(48)) for g in placement.grants)


def test_100_percent_cores_holds_a_device_alone_and_a_busy_device_cannot_give_it():
    busy, idle = gpu_in_fgpu(0, free=D("1.5")), gpu_in_fgpu(1)
    [grant] = place([node("n1", busy, idle)], parse_resources({"gpu": 1, "gpu_memory": "1G", "gpu_cores": 100}), Q25).grants
    assert grant.device_id == "d1" and grant.procs == D(80)
    held = DeviceState(**{**idle.__dict__, "memory_used": GiB, "proc_used": D(80), "sessions": 1})
    with pytest.raises(InsufficientResource, match="held exclusively"):
        place([node("n1", held)], parse_resources({"gpu": 1, "gpu_memory": "1G"}), Q25)


def test_the_split_count_caps_sessions_per_device_in_every_style():
    full = gpu_in_fgpu(0, free=D("1.5"), sessions=2, max_sessions=2)
    with pytest.raises(InsufficientResource, match="split count is 2"):
        place([node("n1", full)], parse_resources({"gpu": 1, "gpu_memory": "1G"}), Q25)
    with pytest.raises(InsufficientResource):
        place([node("n1", full)], parse_resources({"cuda.shares": "0.25"}), Q25)


def test_cores_outside_0_to_100_are_refused_not_clamped():
    for cores in (101, 150, -1):
        with pytest.raises(InvalidResourceRequest, match="gpu_cores"):
            parse_resources({"gpu": 1, "gpu_cores": cores})


def test_metax_vmemory_as_a_bare_number_is_gib_and_goes_to_the_metax_slot():
    request = parse_resources({"metax-tech.com/sgpu": 1, "metax-tech.com/vmemory": 4, "metax-tech.com/vcore": 50})
    assert (request.slot, request.memory.bytes, request.cores) == ("metax", 4 * GiB, D(50))


def test_a_pinned_request_gets_the_device_it_names_by_uuid_or_index():
    nodes = [node("n1", gpu_in_fgpu(0), gpu_in_fgpu(1), gpu_in_fgpu(2))]
    assert place(nodes, parse_resources({"cuda.shares": "0.5", "devices": ["GPU-0002"]}), Q25).grants[0].device_id == "d2"
    assert place(nodes, parse_resources({"gpu": 1, "gpu_memory": "1G", "devices": [1]}), Q25).grants[0].device_id == "d1"
    excluded = place(nodes, parse_resources({"gpu": 1, "gpu_memory": "1G", "exclude": [0, "GPU-0001"]}), Q25)
    assert excluded.grants[0].device_id == "d2"


def test_a_pinned_request_that_cannot_be_met_says_which_device_lacked_what():
    nodes = [node("n1", gpu_in_fgpu(0), gpu_in_fgpu(1, free=D("0.5")))]
    with pytest.raises(InsufficientResource, match=r"device 1 \(GPU-0001\): 2 GiB memory free, 4 GiB asked"):
        place(nodes, parse_resources({"gpu": 1, "gpu_memory": "4G", "devices": ["GPU-0001"]}), Q25)
    with pytest.raises(NeverSchedulable, match="GPU-9999 is not a device of any registered node"):
        place(nodes, parse_resources({"cuda.shares": "0.5", "devices": ["GPU-9999"]}), Q25)


def test_egpu_visible_devices_mix_indexes_and_uuids_and_set_the_count():
    nodes = [node("n1", gpu_in_fgpu(0), gpu_in_fgpu(1), gpu_in_fgpu(2))]
    request = parse_resources({"egpu": {"GPU_MEM_PER_DEVICE": GiB, "NVIDIA_VISIBLE_DEVICES": "0,GPU-0002"}})
    assert sorted(g.device_id for g in place(nodes, request, Q25).grants) == ["d0", "d2"]


def test_numa_keeps_the_devices_on_one_numa_node_or_waits():
    nodes = [node("n1", gpu_in_fgpu(0, numa=0), gpu_in_fgpu(1, numa=1), gpu_in_fgpu(2, numa=1))]
    placement = place(nodes, parse_resources({"gpu": 2, "gpu_memory": "1G", "numa": True}), Q25)
    assert sorted(g.device_id for g in placement.grants) == ["d1", "d2"]
    with pytest.raises(NeverSchedulable):
        place(nodes, parse_resources({"gpu": 3, "gpu_memory": "1G", "numa": True}), Q25)


def test_binpack_takes_the_fullest_device_and_spread_the_emptiest():
    nodes = [node("n1", gpu_in_fgpu(0, free=D(2)), gpu_in_fgpu(1, free=D("1.5")))]
    body = {"gpu": 1, "gpu_memory": "1G"}
    assert place(nodes, parse_resources(body), Q25).grants[0].device_id == "d1"
    assert place(nodes, parse_resources({**body, "policy": "spread"}), Q25).grants[0].device_id == "d0"


def test_an_fgpu_and_a_hami_session_share_one_device_without_over_commit():
    device = gpu_in_fgpu(0)
    [hami] = place([node("n1", device)], parse_resources({"gpu": 1, "gpu_memory": "6G", "gpu_cores": 75}), Q25).grants
    after = DeviceState(**{**device.__dict__, "memory_used": hami.memory, "proc_used": hami.procs, "sessions": 1})
    assert place([node("n1", after)], parse_resources({"cuda.shares": "0.5"}), Q25).grants[0].shares == D("0.5")
    with pytest.raises(InsufficientResource):
        place([node("n1", after)], parse_resources({"cuda.shares": "0.75"}), Q25)


# --- through the API ------------------------------------------------------------------------

@pytest.fixture
def client(db, django_user_model):
    make_cluster(nodes={"style-node": [mock_gpu(0), mock_gpu(1, numa=1)]})
    user = django_user_model.objects.create_user("stylist")
    api = APIClient()
    api.force_authenticate(user)
    return api


def test_the_api_accepts_a_hami_request_and_shows_it_in_the_configuration(client, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post("/api/v1/sessions/", {"name": "hami", "resources": {
            "gpu": 2, "gpu_memory": "4G", "gpu_cores": 60}}, format="json")
    assert response.status_code == 201, response.json()
    body = client.get(f"/api/v1/sessions/{response.json()['id']}/").json()
    assert body["configuration"] == "2 GPU × 4 GiB, 60% cores · 1 core · 1 GiB"
    assert body["status"] == "SCHEDULED"
    assert sorted((a["memory"], a["procs"]) for a in body["allocations"]) == [(4 * GiB, "48.000")] * 2


def test_preview_shows_what_each_device_would_give_and_creates_nothing(client):
    from sessions.models import ComputeSession

    response = client.post("/api/v1/sessions/preview/", {"resources": {"gpu_fraction": "0.25"}}, format="json")
    assert response.status_code == 200
    body = response.json()
    assert body["fits_now"] is True and body["node"] == "style-node"
    assert [(d["memory"], d["sm_percent"]) for d in body["devices"]] == [(2 * GiB, 25)]
    assert ComputeSession.objects.count() == 0


def test_preview_of_an_impossible_request_says_never_and_why(client):
    body = client.post("/api/v1/sessions/preview/", {"resources": {"gpu": 3, "gpu_memory": "1G"}}, format="json").json()
    assert body["never"] is True and body["fits_now"] is False
    # What was asked, the most any node can give, what to do (issue 36.6): in parts and as one reason.
    assert body["never_detail"] == {
        "asked": "cuda: 3 GPUs asked, each with 1 GiB.",
        "most": "The most one node can give is 2 such GPUs (style-node).",
        "advice": "Ask for at most 2 GPUs per session (a session runs on one node).",
    }
    assert body["reason"] == " ".join(body["never_detail"].values())
    assert body["refusal"] == "never-schedulable"


def test_a_pinned_device_no_node_has_is_named_as_such_not_too_large(client):
    """Issue 36.6: an unknown pin is "No such device" (type unknown-device), in the launch's error
    and the preview, not "Request too large"."""
    for pin, words in (("GPU-nope", "no registered node has a device GPU-nope"), (7, "no node has a GPU with index 7")):
        body = {"resources": {"gpu_fraction": "0.25", "devices": [pin]}}
        refused = client.post("/api/v1/sessions/", body, format="json")
        assert refused.status_code == 400
        error = refused.json()
        assert (error["type"], error["title"]) == ("unknown-device", "No such device")
        assert words in error["detail"] and "Request too large" not in refused.content.decode()
        assert error["field_errors"] == {"resources.devices": [error["detail"]]}
        preview = client.post("/api/v1/sessions/preview/", body, format="json").json()
        assert (preview["never"], preview["refusal"], preview["never_detail"]) == (True, "unknown-device", None)
        assert preview["reason"] == error["detail"]


def test_the_api_refuses_cores_above_100_with_the_field_named(client):
    response = client.post("/api/v1/sessions/", {"resources": {"gpu": 1, "gpu_cores": 150}}, format="json")
    assert response.status_code == 400
    assert "gpu_cores" in response.json()["detail"]


def test_only_administrators_may_raise_a_session_s_priority(client):
    response = client.post("/api/v1/sessions/", {"resources": {"cuda.shares": "0.5"}, "priority": 5}, format="json")
    assert response.status_code == 400
    assert "priority" in response.json()["field_errors"]
    lowered = client.post("/api/v1/sessions/", {"resources": {"cuda.shares": "0.5"}, "priority": -3}, format="json")
    assert lowered.status_code == 201 and lowered.json()["priority"] == -3


# --- topology -------------------------------------------------------------------------------

def linked_node():
    from accelerators.allocation.topology import Link

    devices = [gpu_in_fgpu(i) for i in range(4)]
    links = (Link("d0", "d1", "NVLINK", 4), Link("d2", "d3", "PIX"), Link("d0", "d2", "SYS"), Link("d1", "d3", "SYS"),
             Link("d0", "d3", "SYS"), Link("d1", "d2", "SYS"))
    return node("n1", *devices, links=links)


def test_a_two_device_request_takes_the_nvlinked_pair():
    for body in ({"gpu": 2, "gpu_memory": "1G"}, {"cuda.device": 2}):
        grants = place([linked_node()], parse_resources(body), Q25).grants
        assert sorted(g.device_id for g in grants) == ["d0", "d1"], body


def test_a_one_device_request_takes_a_poorly_linked_device_and_keeps_the_nvlink_pair_free():
    [grant] = place([linked_node()], parse_resources({"gpu": 1, "gpu_memory": "1G"}), Q25).grants
    assert grant.device_id in ("d2", "d3")


def test_links_reported_by_an_agent_steer_real_placements(db, django_user_model, django_capture_on_commit_callbacks):
    from accelerators.models import DeviceLink
    from sessions.admission.launch import session_create
    from sessions.tasks import agent_register

    make_cluster(nodes={}, mode="discrete")
    devices = [mock_gpu(i).as_dict() for i in range(4)]
    links = [{"a": devices[1]["device_id"], "b": devices[3]["device_id"], "kind": "NVLINK", "count": 2}]
    with django_capture_on_commit_callbacks(execute=True):
        agent_register(node="linked", inventory={"devices": devices, "links": links, "cpu_count": 8,
                                                 "memory_size": 32 * GiB}, running=[])
    assert DeviceLink.objects.filter(node__name="linked").count() == 1
    owner = django_user_model.objects.create_user("topo-user")
    with django_capture_on_commit_callbacks(execute=True):
        session = session_create(owner=owner, name="pair", resources={"cuda.device": 2})
    held = sorted(a.device.index for a in session.allocations.all())
    assert held == [1, 3]


# --- resource groups ------------------------------------------------------------------------

def test_a_request_naming_a_resource_group_goes_to_its_nodes_under_its_policy(client, django_capture_on_commit_callbacks):
    from accelerators.models import Node, ResourceGroup
    from accelerators.services import node_inventory_apply

    pool = ResourceGroup.objects.create(name="inference", policy="spread")
    node_inventory_apply(node_name="pool-node", devices=[mock_gpu(7), mock_gpu(8)], plugins=[], attributes={},
                         cpu_count=8, memory_size=32 * GiB)
    Node.objects.filter(name="pool-node").update(resource_group=pool)
    body = {"resources": {"gpu": 1, "gpu_memory": "1G", "resource_group": "inference"}}
    with django_capture_on_commit_callbacks(execute=True):
        first = client.post("/api/v1/sessions/", body, format="json").json()
        second = client.post("/api/v1/sessions/", body, format="json").json()
    sessions = [client.get(f"/api/v1/sessions/{s['id']}/").json() for s in (first, second)]
    assert {s["node"] for s in sessions} == {"pool-node"}
    # spread: the second session goes to the other, emptier device
    assert {s["allocations"][0]["device_index"] for s in sessions} == {7, 8}


def test_an_unknown_resource_group_is_refused_naming_the_known_ones(client):
    from accelerators.models import ResourceGroup

    ResourceGroup.objects.create(name="training")
    response = client.post("/api/v1/sessions/", {"resources": {"cuda.shares": "0.5", "resource_group": "nope"}},
                           format="json")
    assert response.status_code == 400
    assert "'nope'" in response.json()["detail"] and "training" in response.json()["detail"]


def test_the_no_fragmentation_guard_splits_into_whole_devices_and_one_remainder():
    nodes = [node("n1", gpu_in_fgpu(0, free=D(1), total=D(1)), gpu_in_fgpu(1, free=D(1), total=D(1)))]
    request = parse_resources({"cuda.shares": "1.5"})
    assert shares_of(place(nodes, request, Q25)) == [D("0.75"), D("0.75")]
    assert sorted(shares_of(place(nodes, request, Q25, no_fragmentation=True))) == [D("0.50"), D("1.00")]
    assert shares_of(place(nodes, parse_resources({"cuda.shares": "0.5"}), Q25, no_fragmentation=True)) == [D("0.50")]
