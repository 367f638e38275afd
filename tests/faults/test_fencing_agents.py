"""Fencing with real processes (issue 33.5): a session deleted while its node is LOST keeps its GPU
until its agent confirms the session's processes are gone, so no device is granted twice while
they may still run.

The stack of tests/faults/conftest.py (web, manager, beat, one agent, a private Redis), its agent's
heartbeat every 1 s and its node LOST after 5 s of silence (HEARTBEATS: the fault stack's 2 s and
10 s halved, five intervals either way, so the frozen agent's node is LOST sooner; issue 34.5); the
node's one GPU is 2 fGPU. The agent is frozen with SIGSTOP (its sessions, in sessions of their own,
keep running), which makes its node LOST; the session holding
the whole GPU is deleted; a second session asks for part of that GPU. Then the agent comes back,
thawed (SIGCONT), or killed and started again (its registration lists what it runs). Every 0.1 s until the second session holds the GPU, the test
checks that it holds nothing while a process of the first is alive.
"""
from __future__ import annotations

import signal

import pytest

from tests.conftest import wait_until
from tests.stack import ApiClient, session_processes

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

NODE = "fault-node-0"
BODY = {"cpu": 1, "mem": "64M"}
HEARTBEATS = {"FGPU_HEARTBEAT_INTERVAL": "1", "FGPU_HEARTBEAT_TIMEOUT": "5"}
# The fence timeout: the heartbeat timeout and 10 s, as the 20 s it was were the fault stack's 10 s and 10 s: the
# node is LOST (the manager's beat looks every 5 s) and the session deleted within those 10 s, before the fence ends it.
FENCE_TIMEOUT_S = 15


def read(session_id: str):
    from django.db import connection

    from sessions.models import ComputeSession

    connection.close()  # a fresh read of what the stack's processes wrote
    return ComputeSession.objects.get(pk=session_id)


def node_status() -> str:
    from accelerators.models import Node

    return Node.objects.get(name=NODE).status


def held(session_id: str) -> int:
    from sessions.models import Allocation

    return Allocation.objects.filter(session_id=session_id, released_at__isnull=True).count()


def lost_with_a_deleted_session(stack, alice_token) -> tuple[ApiClient, str, str]:
    """The whole GPU's session RUNNING with a live process, its agent frozen until its node is LOST,
    the session deleted (TERMINATING, its GPU still held) and a second session launched for part
    of the GPU (PENDING). Returns the client and both ids."""
    client = ApiClient(stack.base, alice_token)
    status, whole = client.launch("whole", {"resources": {"cuda.shares": "2.0", **BODY}})
    assert status == 201, whole
    wait_until(lambda: read(whole["id"]).status == "RUNNING", timeout=60, what="the whole-GPU session to run")
    wait_until(lambda: session_processes([whole["id"]]).get(whole["id"]), timeout=30, what="its process")

    stack.agents[NODE].signal(signal.SIGSTOP)
    wait_until(lambda: node_status() == "LOST", timeout=40, what="the frozen agent's node to be LOST")
    status, deleted = client.delete(whole["id"])

    assert status == 202, deleted
    assert deleted["status"] == "TERMINATING", deleted
    assert f"releasing its devices when node {NODE} confirms its processes are gone, or in " in deleted["status_reason"]
    assert held(whole["id"]) == 1
    assert session_processes([whole["id"]]).get(whole["id"]), "the frozen node's session runs on"
    status, newcomer = client.launch("newcomer", {"resources": {"cuda.shares": "0.5", **BODY}})
    assert status == 201, newcomer
    assert read(newcomer["id"]).status == "PENDING"
    return client, whole["id"], newcomer["id"]


def granted_only_once_gone(whole: str, newcomer: str) -> None:
    """Wait until `newcomer` holds the GPU, checking every 0.1 s that it held nothing while a
    process of `whole` was alive (its allocation read first, the processes after: the strict order)."""
    twice = []

    def placed() -> bool:
        holds = held(newcomer) > 0
        alive = session_processes([whole]).get(whole)
        if holds and alive:
            twice.append(alive)
        return holds and not alive

    wait_until(placed, timeout=90, what="the second session to get the GPU once the first's processes are gone")
    assert not twice, f"the GPU was granted while the deleted session's processes {twice[0]} still ran"
    ended = read(whole)
    assert (ended.status, ended.status_reason, held(whole)) == ("TERMINATED", "at the request of alice", 0)
    wait_until(lambda: read(newcomer).status == "RUNNING", timeout=60, what="the second session to run")


def test_a_session_deleted_while_its_agent_is_frozen_holds_its_gpu_until_the_thawed_agent_stops_it(fault_stack,
                                                                                                     alice_token):
    stack = fault_stack(nodes=1, gpus=1, env=HEARTBEATS)
    _, whole, newcomer = lost_with_a_deleted_session(stack, alice_token)

    stack.agents[NODE].signal(signal.SIGCONT)

    granted_only_once_gone(whole, newcomer)


def test_a_session_deleted_while_its_node_is_lost_holds_its_gpu_until_the_restarted_agent_reports_it_gone(fault_stack,
                                                                                                            alice_token):
    stack = fault_stack(nodes=1, gpus=1, env=HEARTBEATS)
    _, whole, newcomer = lost_with_a_deleted_session(stack, alice_token)
    stack.kill(stack.agent_name(NODE))  # its session runs on, held by its holder; the console cannot know either way

    assert (read(whole).status, held(whole), held(newcomer)) == ("TERMINATING", 1, 0)
    stack.restart(stack.agent_name(NODE))  # it adopts the session, stops it (the stop waits in its queue), reports it gone

    granted_only_once_gone(whole, newcomer)


def test_a_lost_node_marked_dead_ends_its_sessions_and_its_agent_stops_them_when_it_comes_back(fault_stack, alice_token,
                                                                                                 django_user_model):
    from accounts.services import login_token_issue

    stack = fault_stack(nodes=1, gpus=1, env=HEARTBEATS)
    client = ApiClient(stack.base, alice_token)
    status, session = client.launch("on-a-dead-node", {"resources": {"cuda.shares": "1.0", **BODY}})
    assert status == 201, session
    wait_until(lambda: session_processes([session["id"]]).get(session["id"]), timeout=60, what="its process")
    root = ApiClient(stack.base, login_token_issue(user=django_user_model.objects.create_user("root", is_staff=True)))

    assert root.call("POST", f"/api/v1/nodes/{NODE}/mark-dead/")[0] == 409  # ALIVE: its agent says what runs
    stack.agents[NODE].signal(signal.SIGSTOP)
    wait_until(lambda: node_status() == "LOST", timeout=40, what="the frozen agent's node to be LOST")
    status, answer = root.call("POST", f"/api/v1/nodes/{NODE}/mark-dead/")

    assert (status, answer) == (200, {"node": NODE, "sessions_ended": 1})
    ended = read(session["id"])
    assert (ended.status, held(session["id"])) == ("ERROR", 0)
    assert ended.status_reason == f"node {NODE} was marked dead by root: its processes are assumed gone"
    assert session_processes([session["id"]]).get(session["id"]), "an assumption: the frozen node still runs it"

    stack.agents[NODE].signal(signal.SIGCONT)  # it comes back: its first heartbeat lists a session ended here

    wait_until(lambda: not session_processes([session["id"]]).get(session["id"]), timeout=60,
               what="the agent to stop the session the console ended")
    assert node_status() == "ALIVE"


def test_a_lost_node_silent_past_the_fence_timeout_is_declared_dead_by_the_manager(fault_stack, alice_token):
    stack = fault_stack(nodes=1, gpus=1, env={**HEARTBEATS, "FGPU_FENCE_TIMEOUT_SECONDS": str(FENCE_TIMEOUT_S)})
    _, whole, newcomer = lost_with_a_deleted_session(stack, alice_token)
    assert "or in " in read(whole).status_reason

    # The manager's beat (node_check_heartbeats, every 5 s) declares the node dead 15 s after its last heartbeat.
    wait_until(lambda: read(whole).status == "TERMINATED", timeout=60, what="the fence timeout to end the session")
    assert (read(whole).status_reason, held(whole)) == ("at the request of alice", 0)
    assert (read(newcomer).status, node_status()) == ("PENDING", "LOST")  # nothing is placed on a LOST node

    stack.agents[NODE].signal(signal.SIGCONT)  # it comes back: the session it still runs is stopped

    wait_until(lambda: not session_processes([whole]).get(whole), timeout=60, what="the agent to stop the ended session")
