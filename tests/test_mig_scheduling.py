"""MIG requests through session_create and the scheduler (real database): dynamic MIG nodes,
static MIG slices, fixed layouts, MIG and fGPU kept apart, isolation "any"; and end to end with
a real agent on a mock dynamic-MIG H100 node."""
from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from channels.layers import InMemoryChannelLayer

from accelerators.config_import import parse_mock_accelerator_toml
from accelerators.models import GpuInstance, MigMode, Node
from accelerators.plugins.base import DeviceInfo
from common.errors import ApplicationError
from sessions.models import Allocation, ComputeSession, SessionStatus
from agent.core import Agent
from sessions.scheduling.scheduler import _send_starts, schedule_pending
from sessions.lifecycle.services import session_report_apply
from sessions.admission.launch import session_create
from tests.conftest import GiB, make_cluster, mock_gpu
from tests.test_agent_runtime import Harness, RecordingManager
from protocol.messages import StartSpec

pytestmark = pytest.mark.django_db
H100_UUID = "GPU-a1000000-0000-0000-0000-000000000001"
MIG_TOML = Path(__file__).parent / "fixtures" / "backendai" / "cuda-mock-mig.toml"


def h100(index: int = 0, uuid_text: str = H100_UUID) -> DeviceInfo:
    return DeviceInfo(slot_name="cuda", device_id=uuid_text, index=index, mother_uuid=uuid_text[4:], model_name="H100-80GB",
                      numa_node=0, subproc_count=132, memory_size=80 * GiB)


def mig_node(name: str = "mig-node", mode: str = MigMode.DYNAMIC, devices=None) -> Node:
    make_cluster(nodes={name: devices or [h100()]})
    node = Node.objects.get(name=name)
    node.mig_mode = mode
    node.save(update_fields=["mig_mode"])
    return node


def schedule(django_capture_on_commit_callbacks) -> list[tuple[str, dict]]:
    """One scheduler pass; the (node, start spec) pairs it would send to agents."""
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        schedule_pending()
    return [tuple(pair) for cb in callbacks if getattr(cb, "func", None) is _send_starts for pair in cb.args[0]]


def end(session: ComputeSession) -> None:
    assert session_report_apply(session_id=str(session.pk), status="TERMINATED", reason="done", exit_code=0)


def test_a_memory_request_with_mig_isolation_gets_the_smallest_instance_that_holds_it(alice, django_capture_on_commit_callbacks):
    mig_node()
    session = session_create(owner=alice, name="a", resources={"gpu_memory": "15G", "isolation": "mig"})
    [(node, spec)] = schedule(django_capture_on_commit_callbacks)
    session.refresh_from_db()
    assert node == "mig-node" and session.status == SessionStatus.SCHEDULED
    instance = GpuInstance.objects.get()
    assert (instance.profile, instance.session_id, instance.placement_size) == ("1g.20gb", session.pk, 2)
    assert spec["mig"]["profile"] == "1g.20gb" and spec["mig"]["reuse"] is False
    assert spec["mig"]["start"] == instance.placement_start and spec["mig"]["gpu"] == H100_UUID
    assert "1g.20gb" in session.status_reason
    [allocation] = Allocation.objects.filter(session=session)
    assert allocation.memory == 20096 << 20


def test_after_a_session_ends_its_instance_stays_idle_and_the_next_request_reuses_it(alice, django_capture_on_commit_callbacks):
    mig_node()
    first = session_create(owner=alice, name="a", resources={"mig_profile": "2g.20gb"})
    schedule(django_capture_on_commit_callbacks)
    end(first)
    instance = GpuInstance.objects.get()
    second = session_create(owner=alice, name="b", resources={"mig_profile": "2g.20gb"})
    [(_, spec)] = schedule(django_capture_on_commit_callbacks)
    assert spec["mig"]["reuse"] is True and spec["mig"]["instance_id"] == str(instance.pk)
    assert GpuInstance.objects.get().session_id == second.pk


def test_idle_instances_are_destroyed_when_their_slices_are_needed(alice, django_capture_on_commit_callbacks):
    mig_node()
    whole = session_create(owner=alice, name="a", resources={"mig_profile": "7g.80gb"})
    schedule(django_capture_on_commit_callbacks)
    end(whole)
    session_create(owner=alice, name="b", resources={"gpu_memory": "4G", "isolation": "mig"})
    [(_, spec)] = schedule(django_capture_on_commit_callbacks)
    assert spec["mig"]["profile"] == "1g.10gb" and spec["mig"]["destroy"] == [{"profile": "7g.80gb", "start": 0}]
    assert [g.profile for g in GpuInstance.objects.all()] == ["1g.10gb"]


def test_a_full_gpu_makes_mig_requests_wait_with_the_reason(alice, django_capture_on_commit_callbacks):
    mig_node()
    session_create(owner=alice, name="a", resources={"mig_profile": "7g.80gb"})
    waiting = session_create(owner=alice, name="b", resources={"mig_profile": "1g.10gb"})
    schedule(django_capture_on_commit_callbacks)
    waiting.refresh_from_db()
    assert waiting.status == SessionStatus.PENDING and "waiting for capacity" in waiting.status_reason
    assert "7g.80gb@0" in waiting.status_reason


def test_a_mig_request_no_node_could_ever_hold_is_refused_at_launch(alice):
    with pytest.raises(ApplicationError, match="no node has MIG enabled"):
        session_create(owner=alice, name="a", resources={"mig_profile": "1g.10gb"})
    mig_node()
    with pytest.raises(ApplicationError, match="no MIG node could ever hold a MIG instance of 100 GiB"):
        session_create(owner=alice, name="a", resources={"gpu_memory": "100G", "isolation": "mig"})
    with pytest.raises(ApplicationError, match="no MIG node could ever hold MIG profile 1g.5gb"):
        session_create(owner=alice, name="a", resources={"mig_profile": "1g.5gb"})  # an A100 profile


def test_a_mig_node_that_is_gone_makes_a_scheduled_request_fail_in_error(alice, django_capture_on_commit_callbacks):
    node = mig_node()
    session = session_create(owner=alice, name="a", resources={"gpu_memory": "60G", "isolation": "mig"})
    node.devices.update(model_name="NVIDIA A100-SXM4-40GB", memory_size=40 * GiB)  # the agent now reports an A100
    schedule(django_capture_on_commit_callbacks)
    session.refresh_from_db()
    assert session.status == SessionStatus.ERROR and "no MIG node could ever hold" in session.status_reason


def test_fgpu_shares_never_land_on_a_dynamic_mig_gpu(alice, django_capture_on_commit_callbacks):
    mig_node()
    make_cluster(nodes={"plain": [mock_gpu(0)]})
    shared = session_create(owner=alice, name="s", resources={"cuda.shares": "0.5"})
    [(node, _)] = schedule(django_capture_on_commit_callbacks)
    assert node == "plain"
    assert not Allocation.objects.filter(session=shared, device__node__name="mig-node").exists()


def test_isolation_any_takes_mig_where_it_can_and_a_shared_slice_otherwise(alice, django_capture_on_commit_callbacks):
    mig_node()
    make_cluster(nodes={"plain": [mock_gpu(0)]})
    session_create(owner=alice, name="whole", resources={"mig_profile": "7g.80gb"})
    schedule(django_capture_on_commit_callbacks)
    either = session_create(owner=alice, name="either", resources={"gpu_memory": "2G", "isolation": "any"})
    [(node, spec)] = schedule(django_capture_on_commit_callbacks)
    assert node == "plain" and "mig" not in spec
    assert Allocation.objects.get(session=either).memory == 2 * GiB
    end(ComputeSession.objects.get(name="whole"))
    again = session_create(owner=alice, name="either2", resources={"gpu_memory": "2G", "isolation": "any"})
    [(node, spec)] = schedule(django_capture_on_commit_callbacks)
    assert node == "mig-node" and spec["mig"]["profile"] == "1g.10gb"
    assert GpuInstance.objects.get(session=again).profile == "1g.10gb"


def test_a_fixed_layout_node_gives_only_the_instances_it_has(alice, django_capture_on_commit_callbacks):
    node = mig_node(mode=MigMode.FIXED)
    GpuInstance.objects.create(node=node, parent=node.devices.get(), profile="3g.40gb", placement_start=4,
                               placement_size=4, memory_size=39 * GiB, subproc_count=60)
    got = session_create(owner=alice, name="a", resources={"gpu_memory": "30G", "isolation": "mig"})
    waits = session_create(owner=alice, name="b", resources={"gpu_memory": "4G", "isolation": "mig"})
    [(_, spec)] = schedule(django_capture_on_commit_callbacks)
    assert spec["mig"]["reuse"] and spec["session_id"] == str(got.pk)
    waits.refresh_from_db()
    assert waits.status == SessionStatus.PENDING and "fixed layout" in waits.status_reason


def test_static_slices_of_an_inventory_are_whole_devices_asked_for_by_profile(alice, django_capture_on_commit_callbacks):
    config = parse_mock_accelerator_toml(MIG_TOML)
    make_cluster(nodes={"static": list(config.devices)})
    Node.objects.filter(name="static").update(mig_mode=MigMode.STATIC)
    a = session_create(owner=alice, name="a", resources={"mig_profile": "10g"})
    b = session_create(owner=alice, name="b", resources={"mig_profile": "10g"})
    c = session_create(owner=alice, name="c", resources={"mig_profile": "10g"})
    starts = schedule(django_capture_on_commit_callbacks)
    uuids = [spec["devices"][0]["device_id"] for _, spec in starts]
    assert len(uuids) == 2 and len(set(uuids)) == 2 and all(u.startswith("MIG-") for u in uuids)
    assert all(spec["devices"][0]["memory_limit"] == 10 * GiB and "mig" not in spec for _, spec in starts)
    c.refresh_from_db()
    assert c.status == SessionStatus.PENDING and {a.pk, b.pk} == set(
        Allocation.objects.filter(device__is_mig_device=True).values_list("session_id", flat=True))
    small = session_create(owner=alice, name="d", resources={"gpu_memory": "4G", "isolation": "mig"})
    [(_, spec)] = schedule(django_capture_on_commit_callbacks)
    assert spec["session_id"] == str(small.pk) and spec["devices"][0]["mig_profile"] == "5g"


def test_a_gpu_with_static_mig_slices_is_not_offered_for_fgpu(alice, django_capture_on_commit_callbacks):
    gpu = mock_gpu(0)
    slice_ = DeviceInfo(slot_name="cuda", device_id="MIG-x/0", index=0, mother_uuid=gpu.mother_uuid,
                        model_name="MIG-5g", numa_node=0, subproc_count=14, memory_size=5 * GiB, is_mig_device=True,
                        mig_profile="5g", parent_device_id=gpu.device_id)
    make_cluster(nodes={"mixed": [gpu, slice_]})
    with pytest.raises(ApplicationError, match="largest any node can hold is 0.00 fGPU"):
        session_create(owner=alice, name="s", resources={"cuda.shares": "0.5"})


# --- end to end: scheduler → real agent (mock node) → nvidia-smi ---------------------------------

def test_end_to_end_a_15g_mig_session_gets_1g_20gb_sees_it_in_nvidia_smi_and_the_next_reuses_it(
        alice, tmp_path, django_capture_on_commit_callbacks):
    mig_node()
    loop = asyncio.new_event_loop()
    layer = InMemoryChannelLayer()

    async def setup():
        manager = RecordingManager(asyncio.get_running_loop())
        inventory = {"devices": [h100().as_dict()], "plugins": ["ai.backend.accelerator.mock"],
                     "attributes": {}, "cpu_count": 8, "memory_size": 32 * GiB}
        agent = Agent(node=f"mig-node-{uuid.uuid4().hex[:6]}", inventory=inventory, channel_layer=layer,
                      manager=manager, scratch_root=tmp_path / "scratch", mock=True, heartbeat_s=60)
        await agent.start()
        return Harness(agent, manager, layer)

    async def run(h: Harness, spec: dict) -> str:
        channel = await h.watch_terminal(spec["session_id"])
        await asyncio.to_thread(h.agent.submit_start, StartSpec.decode(spec))
        output = await h.read_until(channel, "END")
        await h.manager.wait_for_report(spec["session_id"], "TERMINATED")
        return output

    h = loop.run_until_complete(setup())
    command = "nvidia-smi --query-gpu=memory.total,name --format=csv,noheader; echo VIS=$CUDA_VISIBLE_DEVICES END"
    try:
        outputs = []
        for name in ("first", "second"):
            session = session_create(owner=alice, name=name, resources={"gpu_memory": "15G", "isolation": "mig"},
                                     command=command)
            [(_, spec)] = schedule(django_capture_on_commit_callbacks)
            outputs.append((spec, loop.run_until_complete(run(h, spec))))
            for status, reason, code in h.manager.reports_for(str(session.pk)):
                session_report_apply(session_id=str(session.pk), status=status, reason=reason, exit_code=code)
            session.refresh_from_db()
            assert session.status == SessionStatus.TERMINATED, session.status_reason
        (spec1, out1), (spec2, out2) = outputs
        assert spec1["mig"]["profile"] == "1g.20gb" and not spec1["mig"]["reuse"]
        assert "20096 MiB" in out1 and "VIS=MIG-" in out1
        assert spec2["mig"]["reuse"] and spec2["mig"]["instance_id"] == spec1["mig"]["instance_id"]
        uuid1 = out1.split("VIS=")[1].split()[0]
        assert f"VIS={uuid1}" in out2
        assert [step for step, *_ in h.agent.mig.timings] == ["create"]  # created once, reused after
        assert GpuInstance.objects.get().session.name == "second"
    finally:
        loop.run_until_complete(h.agent.shutdown())
        loop.close()


def test_the_session_page_says_which_kind_of_slice_it_got_and_why(alice, django_capture_on_commit_callbacks):
    from sessions.selectors import session_configuration

    mig_node()
    make_cluster(nodes={"plain": [mock_gpu(0)]})
    mig = session_create(owner=alice, name="m", resources={"gpu_memory": "15G", "isolation": "mig"})
    schedule(django_capture_on_commit_callbacks)
    mig.refresh_from_db()
    text = session_configuration(mig)
    assert text.startswith("MIG instance of at least 15 GiB")
    assert "got MIG 1g.20gb on GPU 0 (memory slices" in text and "the smallest MIG instance that holds 15 GiB" in text
    session_create(owner=alice, name="whole", resources={"mig_profile": "4g.40gb"})
    session_create(owner=alice, name="three", resources={"mig_profile": "1g.20gb"})
    either = session_create(owner=alice, name="e", resources={"gpu_memory": "2G", "isolation": "any"})
    schedule(django_capture_on_commit_callbacks)
    either.refresh_from_db()
    assert session_configuration(either).endswith("got a shared slice of GPU 0: no MIG instance could hold it when "
                                                  "it was placed")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_launches_and_ends_through_the_scheduler_keep_every_gpu_layout_creatable(
        alice, django_capture_on_commit_callbacks, seed):
    """A seeded random walk of MIG launches and ends on two dynamic GPUs (H100-80GB, A100-40GB):
    after every pass each GPU's GpuInstance rows are a creatable layout, an idle instance of
    the profile given was reused rather than a new one created, and no session got a larger
    profile than the smallest its GPU could place."""
    import random

    from accelerators.allocation import mig

    rng = random.Random(seed)
    mig_node(devices=[h100(0), DeviceInfo(slot_name="cuda", device_id="GPU-a100", index=1, mother_uuid="a100",
                                          model_name="NVIDIA A100-SXM4-40GB", numa_node=0, subproc_count=108,
                                          memory_size=40 * GiB)])
    Node.objects.filter(name="mig-node").update(cpu_count=1000, memory_size=1000 * GiB)
    sizes = ["3G", "5G", "9G", "15G", "19G", "25G", "39G", "70G"]
    for step in range(40):
        live = list(ComputeSession.objects.filter(status=SessionStatus.SCHEDULED))
        if live and rng.random() < 0.4:
            end(rng.choice(live))
            continue
        before = {gpu: [mig.MigInstance(str(g.pk), g.profile, g.placement_start,
                                        g.session is not None and g.session.status == SessionStatus.SCHEDULED)
                        for g in GpuInstance.objects.filter(parent__device_id=gpu).select_related("session")]
                  for gpu in (H100_UUID, "GPU-a100")}
        size = rng.choice(sizes)
        session_create(owner=alice, name=f"s{step}", resources={"gpu_memory": size, "isolation": "mig"})
        starts = schedule(django_capture_on_commit_callbacks)
        for _, spec in starts[:1]:  # later starts of the same pass saw the first one's layout
            block = spec["mig"]
            request = mig.MigRequest(
                memory=ComputeSession.objects.get(pk=spec["session_id"]).request_spec["memory"]["bytes"])
            for gpu, layout in before.items():
                catalog = mig.catalog_get("H100-80GB" if gpu == H100_UUID else "A100-40GB")
                try:
                    plan = mig.plan_instance(catalog, layout, request)
                except (mig.InsufficientResource, mig.NeverSchedulable):
                    assert gpu != block["gpu"]
                    continue
                if gpu == block["gpu"]:
                    assert plan.profile.name == block["profile"] and block["reuse"] == bool(plan.reuse)
                    if any(not i.in_use and i.profile == block["profile"] for i in layout):
                        assert block["reuse"]  # released instances are reused before new ones are created
                else:  # no GPU could place a smaller profile
                    assert plan.profile.memory >= catalog_memory(block)
        for gpu in (H100_UUID, "GPU-a100"):
            rows = GpuInstance.objects.filter(parent__device_id=gpu)
            if not rows:
                continue
            catalog = mig.catalog_get(rows[0].parent.model_name, memory_size=rows[0].parent.memory_size)
            layout = [mig.MigInstance(str(g.pk), g.profile, g.placement_start) for g in rows]
            assert mig.layout_problems(catalog, layout) == []


def catalog_memory(block: dict) -> int:
    from accelerators.allocation import mig

    return mig.catalog_get(block["model_name"], memory_size=block["memory_size"]).profile(block["profile"]).memory


def test_a_catalog_the_agent_read_from_nvml_is_planned_with_instead_of_the_built_in_one(
        alice, django_capture_on_commit_callbacks):
    """An A100 80GB on driver 515 offers no 1g.20gb (mig-profiles.csv): 15G then needs 2g.20gb."""
    from dataclasses import replace

    from accelerators.allocation import mig

    built_in = mig.CATALOGS["A100-80GB"]
    reported = replace(built_in, profiles=tuple(p for p in built_in.profiles if p.name != "1g.20gb"), source="NVML")
    gpu = replace(h100(), model_name="NVIDIA A100 80GB PCIe", subproc_count=108,
                  mig_catalog=mig.catalog_as_dict(reported))
    mig_node(devices=[gpu])
    session_create(owner=alice, name="a", resources={"gpu_memory": "15G", "isolation": "mig"})
    [(_, spec)] = schedule(django_capture_on_commit_callbacks)
    assert spec["mig"]["profile"] == "2g.20gb"


def test_mig_sessions_that_start_past_a_waiting_head_count_as_backfill_until_the_limit(
        alice, settings, django_capture_on_commit_callbacks):
    settings.FGPU_BACKFILL_LIMIT = 1
    mig_node()
    session_create(owner=alice, name="busy", resources={"mig_profile": "1g.10gb"})
    schedule(django_capture_on_commit_callbacks)
    head = session_create(owner=alice, name="head", resources={"mig_profile": "7g.80gb"})  # the whole GPU: not now
    first = session_create(owner=alice, name="first", resources={"mig_profile": "1g.10gb"})
    second = session_create(owner=alice, name="second", resources={"mig_profile": "1g.10gb"})

    schedule(django_capture_on_commit_callbacks)

    for session in (head, first, second):
        session.refresh_from_db()
    assert (head.status, head.overtaken) == (SessionStatus.PENDING, 1)  # the pass's one backfill, by a MIG session
    assert first.status == SessionStatus.SCHEDULED
    assert second.status == SessionStatus.PENDING and "queued behind" in second.status_reason


def test_a_mig_session_waits_while_its_node_has_too_few_cpu_cores_left(alice, django_capture_on_commit_callbacks):
    mig_node()  # 8 cores, 32 GiB of memory
    session_create(owner=alice, name="wide", resources={"mig_profile": "1g.10gb", "cpu": 6})
    narrow = session_create(owner=alice, name="narrow", resources={"mig_profile": "1g.10gb", "cpu": 4, "mem": "1G"})

    schedule(django_capture_on_commit_callbacks)

    narrow.refresh_from_db()
    assert narrow.status == SessionStatus.PENDING
    assert "mig-node: not enough CPU cores or memory left" in narrow.status_reason
