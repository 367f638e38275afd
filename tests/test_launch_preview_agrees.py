"""The launch preview is the launch's decision without the write (issue 19): against random
cluster states — nodes of different sizes, some LOST, sessions running and waiting, quotas of
users and projects — the preview of a random request says what launching it then does: refused
for the same reason (never fits, or the same quota sentences), started on the same node and
devices with the same memory and SMs, or waiting with the very reason the session shows.

Real PostgreSQL; each launch is rolled back (a savepoint) before the next request, so every
request of a state sees the same state. A launch (its pass included) costs ~0.1–0.4 s here, so
the default run compares 250 requests (10 states × 25) in about a minute;
FGPU_AGREEMENT_REQUESTS=1000 runs the issue's 1,000 (40 states × 25).
"""
from __future__ import annotations

import os
from decimal import Decimal as D

import pytest
from django.db import transaction
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from accelerators.models import Node, NodeStatus, ResourceGroup
from common.errors import ApplicationError
from sessions.admission.launch import launch_preview
from sessions.models import ComputeSession, Project, Quota, SessionStatus
from sessions.scheduling.scheduler import schedule_pending
from sessions.lifecycle.services import session_report_apply, session_terminate
from sessions.admission.launch import session_create
from tests.conftest import GiB, make_cluster, mock_gpu

REQUESTS_PER_STATE = 25
STATES = max(1, int(os.environ.get("FGPU_AGREEMENT_REQUESTS") or 250) // REQUESTS_PER_STATE)

requests = st.one_of(
    st.builds(lambda q: {"cuda.shares": str(D(q) / 4)}, st.integers(1, 20)),  # 0.25 … 5 fGPU
    st.builds(lambda n, m, c: {"gpu": n, "gpu_memory": f"{m}G", "gpu_cores": c},
              st.integers(1, 3), st.integers(1, 12), st.sampled_from([0, 25, 50, 100])),
    st.builds(lambda f: {"gpu_fraction": str(D(f) / 10)}, st.integers(1, 10)),
    st.builds(lambda p: {"gpu": 1, "gpu_memory_percentage": p}, st.sampled_from([10, 50, 100])),
    st.builds(lambda n: {"cpu": n}, st.integers(1, 10)),
    st.builds(lambda q, cpu: {"cuda.shares": str(D(q) / 4), "cpu": cpu}, st.integers(1, 8), st.integers(1, 10)),
)
nodes = st.lists(st.tuples(st.lists(st.sampled_from([8, 16]), min_size=1, max_size=3),  # GPUs' GiB
                           st.integers(2, 8),  # CPU cores
                           st.booleans()),  # LOST after the sessions were placed
                 min_size=1, max_size=3)
limits = st.fixed_dictionaries({
    "max_fgpu": st.sampled_from([None, D("0.5"), D(1), D(2), D(4)]),
    "max_sessions": st.sampled_from([None, 1, 2, 4]),
    "max_gpu_memory": st.sampled_from([None, 4 * GiB, 8 * GiB, 16 * GiB]),
    "max_devices": st.sampled_from([None, 1, 2]),
})
states = st.fixed_dictionaries({
    "nodes": nodes,
    "sessions": st.lists(st.tuples(st.sampled_from(["alice", "bob"]), requests), max_size=6),
    "ended": st.integers(0, 5),  # that many of the placed sessions end (allocations released)
    "alice": st.one_of(st.none(), limits),
    "project": st.one_of(st.none(), limits),  # alice and bob's project
    "asked": st.lists(requests, min_size=REQUESTS_PER_STATE, max_size=REQUESTS_PER_STATE),
})


def launched(owner, resources: dict) -> tuple:
    """What launching `resources` does (then rolled back): ("refused", type, detail, problems),
    or (status, node, reason, grants) once one scheduler pass ran."""
    with transaction.atomic():
        try:
            session = session_create(owner=owner, name="", resources=resources)
        except ApplicationError as exc:
            transaction.set_rollback(True)
            return "refused", exc.type, exc.detail, exc.field_errors.get("resources", [])
        schedule_pending()
        session.refresh_from_db()
        grants = sorted((a.device.device_id, a.memory, D(a.procs)) for a in session.allocations.select_related("device"))
        reason = session.status_reason if session.status != SessionStatus.SCHEDULED else None  # what it got, in words
        answer = (session.status, session.node.name if session.node_id else None, reason, grants)
        transaction.set_rollback(True)
    return answer


def previewed(owner, resources: dict) -> tuple:
    """The preview's answer in `launched`'s terms."""
    try:
        body = launch_preview(resources=resources, owner=owner)
    except ApplicationError as exc:
        return "refused", exc.type, exc.detail, exc.field_errors.get("resources", [])
    if body["outcome"] == "refused":
        return "refused", body["refusal"], body["reason"], body["problems"] or [body["reason"]]
    if body["outcome"] == "waits":
        return SessionStatus.PENDING, None, body["status_reason"], []
    grants = sorted((d["device"], d["memory"], D(d["procs"])) for d in body["devices"])
    return SessionStatus.SCHEDULED, body["node"], None, grants


def build(state: dict, users: dict) -> None:
    """The state: its nodes, its sessions placed by one pass (those left waiting stay PENDING),
    some ended, the LOST nodes marked so, then the quotas (written after the sessions they count,
    so the state may be over a quota already)."""
    make_cluster(nodes={f"n{i}": [mock_gpu(j, node=i, memory=size * GiB) for j, size in enumerate(gpus)]
                        for i, (gpus, _, _) in enumerate(state["nodes"])}, cpu=8)
    for i, (_, cpu, _) in enumerate(state["nodes"]):
        Node.objects.filter(name=f"n{i}").update(cpu_count=cpu)
    for name, resources in state["sessions"]:
        try:
            session_create(owner=users[name], name="", resources=resources)
        except ApplicationError:
            pass  # never fits: no session
    schedule_pending()
    for session in ComputeSession.objects.filter(status=SessionStatus.SCHEDULED).order_by("created_at")[:state["ended"]]:
        session_terminate(session=session)
        session.refresh_from_db()
        session_report_apply(session_id=str(session.pk), status="TERMINATED", reason="done", exit_code=0)
    lost = [f"n{i}" for i, (_, _, is_lost) in enumerate(state["nodes"]) if is_lost]
    Node.objects.filter(name__in=lost).update(status=NodeStatus.LOST)
    if state["alice"] is not None:
        Quota.objects.create(user=users["alice"], **state["alice"])
    if state["project"] is not None:
        project = Project.objects.create(name="team")
        project.members.set([users["alice"], users["bob"]])
        Quota.objects.create(project=project, **state["project"])
    schedule_pending()  # as after each end in a real cluster: the sessions still waiting cannot start now


@pytest.fixture
def users(db, django_user_model):
    return {name: django_user_model.objects.create_user(name) for name in ("alice", "bob")}


@settings(max_examples=STATES, deadline=None, database=None, phases=(Phase.explicit, Phase.generate),
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(state=states)
def test_the_preview_says_what_the_launch_then_does(users, state):
    with transaction.atomic():  # the state, rolled back after this example
        build(state, users)
        alice = users["alice"]
        for resources in state["asked"]:
            preview, launch = previewed(alice, resources), launched(alice, resources)
            assert preview == launch, (resources, state)
        transaction.set_rollback(True)


def test_the_check_can_fail_a_preview_that_ignores_the_quota(users):
    """The comparison above sees a disagreement: with alice at her sessions quota, a preview
    without her quotas says it starts; the launch is refused."""
    make_cluster(nodes={"n0": [mock_gpu(0)]})
    Quota.objects.create(user=users["alice"], max_sessions=0)
    blind = launch_preview(resources={"cuda.shares": "0.5"})

    assert blind["outcome"] == "starts"
    assert previewed(users["alice"], {"cuda.shares": "0.5"}) == launched(users["alice"], {"cuda.shares": "0.5"})
    assert launched(users["alice"], {"cuda.shares": "0.5"})[:2] == ("refused", "quota-exceeded")


def test_a_group_reserved_for_a_project_the_user_is_not_in_is_refused_by_the_preview_as_by_the_launch(users):
    make_cluster(nodes={"n0": [mock_gpu(0)]})
    group = ResourceGroup.objects.create(name="vision-only")
    Node.objects.filter(name="n0").update(resource_group=group)
    Project.objects.create(name="vision").resource_groups.add(group)
    resources = {"cuda.shares": "0.5", "resource_group": "vision-only"}

    body = launch_preview(resources=resources, owner=users["alice"])

    assert (body["outcome"], body["refusal"]) == ("refused", "resource-group-reserved")
    assert previewed(users["alice"], resources) == launched(users["alice"], resources)


def test_with_its_only_node_lost_the_preview_says_it_waits_as_the_launch_then_does(users):
    """Issue 19's first disagreement: the preview answered never ("no GPU node is registered
    yet") while the launch of the same request gave PENDING."""
    make_cluster(nodes={"n0": [mock_gpu(0)]})
    Node.objects.filter(name="n0").update(status=NodeStatus.LOST)
    body = launch_preview(resources={"cuda.shares": "0.5"}, owner=users["alice"])

    assert (body["outcome"], body["never"]) == ("waits", False)
    assert body["status_reason"].endswith("are not alive (LOST)")  # the default image's nodes, or any node's
    assert launched(users["alice"], {"cuda.shares": "0.5"})[:3] == (SessionStatus.PENDING, None, body["status_reason"])
