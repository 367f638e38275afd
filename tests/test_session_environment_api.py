"""The session API's `environment` (issue 19.3): the variables a session's allocation puts into
its environment, by the agent's own rule (protocol.environment.limits_environment), so `fgpu
describe` prints it instead of computing a copy. The database is real; the agent is the
recording stand-in of tests/test_reconcile.py."""
from __future__ import annotations

import dataclasses

import pytest

from accelerators.models import Node
from protocol.environment import session_environment
from protocol.messages import StartSpec
from sessions.lifecycle import services
from sessions.admission import launch as admission
from sessions.models import ComputeSession, SessionStatus
from tests.conftest import client_for
from tests.test_reconcile import NODE, RecordingAgent, agent, scheduled  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db(transaction=True)
OWN = ("PATH", "HOME", "TERM", "LANG", "FGPU_SESSION_ID", "FGPU_SESSION_NAME", "FGPU_ALLOCATION")


def started_with(spec: dict | StartSpec, *, mps: bool = False) -> dict[str, str]:
    """What the agent puts into the environment of a session started from `spec` (as sent, or
    decoded), less the session's own variables (paths on the node, its id)."""
    start = spec if isinstance(spec, StartSpec) else StartSpec.decode(spec)
    env = session_environment(start, allocation_path="/a", bin_dir="/b", work_dir="/w", base_path="/usr/bin", mps=mps)
    return {name: value for name, value in env.items() if name not in OWN}


def environment_of(session, user) -> dict:
    answer = client_for(user).get(f"/api/v1/sessions/{session.pk}/")
    assert answer.status_code == 200, answer.content
    listed = client_for(user).get("/api/v1/sessions/").json()["results"]
    assert [s["environment"] for s in listed if s["id"] == str(session.pk)] == [answer.json()["environment"]]
    return answer.json()["environment"]


def test_a_placed_session_shows_the_environment_its_agent_starts_it_with(scheduled, alice):
    session = scheduled("0.5")

    environment = environment_of(session, alice)

    assert environment == started_with(session.first_spec)
    assert environment["CUDA_DEVICE_MEMORY_LIMIT_0"] == "2048m" and environment["GPU_UTIL_PER_DEVICE"] == "25"


def test_a_node_running_mps_adds_the_mps_limits_as_its_agent_does(scheduled, alice):
    node = Node.objects.get(name=NODE)
    node.attributes = {**(node.attributes or {}), "mps": True}
    node.save(update_fields=["attributes"])
    session = scheduled("0.5")

    environment = environment_of(session, alice)

    assert environment == started_with(session.first_spec, mps=True)
    assert environment["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"


def test_a_pending_session_has_none_and_an_ended_one_keeps_what_it_had(scheduled, agent, alice):
    session = scheduled("0.5")
    held = environment_of(session, alice)
    waiting = admission.session_create(owner=alice, name="big", resources={"cuda.shares": "2"})  # the whole GPU

    assert ComputeSession.objects.get(pk=waiting.pk).status == SessionStatus.PENDING
    assert environment_of(waiting, alice) == {}
    services.session_terminate(session=session, reason="done")
    services.session_report_apply(session_id=str(session.pk), status="TERMINATED")
    assert ComputeSession.objects.get(pk=session.pk).status == SessionStatus.TERMINATED
    assert environment_of(session, alice) == held


@pytest.fixture
def mig_agent():
    """A dynamic-MIG H100 node (tests/test_mig_scheduling.py's) with the recording stand-in as its agent."""
    from agent import core as agent_runtime
    from tests.test_mig_scheduling import mig_node

    mig_node()
    stand_in = RecordingAgent()
    agent_runtime._AGENTS["mig-node"] = stand_in
    yield stand_in
    agent_runtime._AGENTS.pop("mig-node", None)


def test_a_dynamic_mig_session_shows_its_mig_device_as_its_agent_starts_it(mig_agent, alice):
    from accelerators.models import GpuInstance
    from accelerators.plugins.cuda_mig import LiveInstance
    from agent.mig import device_entry

    session = admission.session_create(owner=alice, name="mig", resources={"gpu_memory": "15G", "isolation": "mig"})
    spec = mig_agent.starts[-1]
    instance = GpuInstance.objects.get(session=session)
    # The agent creates the instance and starts the session on its MIG device (agent.mig.prepare_spec).
    live = LiveInstance(gpu=spec["mig"]["gpu"], profile=instance.profile, start=instance.placement_start,
                        size=instance.placement_size, gpu_instance_id=1, uuid="MIG-5e2d0f3a-0000-0000-0000-000000000001",
                        memory=instance.memory_size, sm_count=instance.subproc_count)
    GpuInstance.objects.filter(pk=instance.pk).update(uuid=live.uuid)
    start = StartSpec.decode(spec)
    started = dataclasses.replace(start, devices=(device_entry(start.devices[0], live),))

    environment = environment_of(session, alice)

    assert environment == started_with(started)
    assert environment["CUDA_VISIBLE_DEVICES"] == live.uuid and environment["CUDA_DEVICE_SM_LIMIT"] == "0"
