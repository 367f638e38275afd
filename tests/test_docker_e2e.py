"""Sessions in containers, end to end on the distributed stack (issue 13), from outside as a user
would: uvicorn, a Celery manager, beat and an agent process whose agent.toml says
`runtime = "docker"` (network none, the session test image built by tests/images/build.sh).

Two users' sessions run side by side; through the terminal websocket and the exec API each
sees its own slice and nothing of the other, the node or the console."""
from __future__ import annotations

import asyncio
import re

import docker
import pytest

from tests.conftest import ROOT, StackNode, wait_until
from tests.test_e2e_distributed import api, get_ok, terminal_run

pytestmark = [pytest.mark.e2e, pytest.mark.docker, pytest.mark.django_db(transaction=True)]
REDIS_DB = 14


TEST_IMAGE = "fgpu-session:test"  # what the docker node holds (tests/images/build.sh); sessions ask for it


@pytest.fixture
def cluster(distributed_stack, django_user_model):
    from sessions.models import SessionImage

    SessionImage.objects.get_or_create(reference=TEST_IMAGE)  # registered, as an administrator would
    stack = distributed_stack(nodes=[StackNode("docker-node", (ROOT / "demo" / "mock-accelerator.toml").read_text(),
                                               runtime="docker")], redis_db=REDIS_DB)
    tokens = {}
    for name in ("alice", "bob"):
        django_user_model.objects.create_user(name, password=f"{name}-pass-123")
        status, body = api(stack.base, "POST", "/api/v1/auth/token/",
                           body={"username": name, "password": f"{name}-pass-123"})
        assert status == 200, body
        tokens[name] = body["token"]
    return stack, tokens


def launch(base: str, token: str, body: dict) -> dict:
    status, created = api(base, "POST", "/api/v1/sessions/", token, body)
    assert status == 201, created
    return wait_until(lambda: (s := get_ok(base, f"/api/v1/sessions/{created['id']}/", token))["status"] in (
        "RUNNING", "TERMINATED", "ERROR") and s, timeout=60, what="the session to start")


def terminal_url(base: str, token: str, session_id: str) -> str:
    status, ticket = api(base, "POST", f"/api/v1/sessions/{session_id}/terminal-ticket/", token, {})
    assert status == 200, ticket
    return base.replace("http://", "ws://") + ticket["url"]


def exec_in(base: str, token: str, session_id: str, command: str) -> dict:
    status, result = api(base, "POST", f"/api/v1/sessions/{session_id}/exec/", token, {"command": command})
    assert status == 200, result
    return result


def test_a_containered_session_sees_its_slice_and_nothing_of_other_sessions_the_node_or_the_console(cluster):
    stack, tokens = cluster
    base = stack.base
    bob = launch(base, tokens["bob"], {"name": "bobs", "image": TEST_IMAGE,
                                       "resources": {"cuda.shares": "0.5", "cpu": 1, "mem": "1G"}})
    assert bob["status"] == "RUNNING", bob
    exec_in(base, tokens["bob"], bob["id"], "echo secret > private.txt && chmod 600 private.txt")
    alice = launch(base, tokens["alice"], {"name": "alices", "image": TEST_IMAGE,
                                           "resources": {"cuda.shares": "0.5", "cpu": 1, "mem": "1G"}})
    assert alice["status"] == "RUNNING", alice

    output = asyncio.run(terminal_run(terminal_url(base, tokens["alice"], alice["id"]),
                                      "nvidia-smi; id -u; echo end-$((6*7))\r", "end-42", timeout=30))
    assert "2048MiB" in output, output
    uid = re.search(r"^(\d+)\r?$", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", output), re.M)
    assert uid and uid.group(1) != "0", output

    scratch = stack.agents["docker-node"].log_path.parent / "nodes" / "docker-node" / "scratches"
    peek = exec_in(base, tokens["alice"], alice["id"], f"cat {scratch}/{bob['id']}/private.txt; ls /home/work/..")
    assert "secret" not in peek["stdout"] + peek["stderr"] and peek["stdout"].split() == ["work"], peek
    processes = exec_in(base, tokens["alice"], alice["id"], "ps -e -o comm=")["stdout"].split()
    assert set(processes) <= {"docker-init", "bash", "ps"}, processes  # its own PID namespace only
    console = exec_in(base, tokens["alice"], alice["id"], f"ls {ROOT}/console; env | grep -c -E 'DATABASE|REDIS|SECRET'")
    assert "No such file or directory" in console["stderr"] and console["stdout"].strip() == "0", console
    quota = exec_in(base, tokens["alice"], alice["id"], "cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us /sys/fs/cgroup/cpu.max "
                                                        "2>/dev/null; true")
    assert "100000" in quota["stdout"], quota  # 1 CPU: a CFS quota of 100 ms per 100 ms period

    wait_until(lambda: "end-42" in get_ok(base, f"/api/v1/sessions/{alice['id']}/logs/", tokens["alice"])["text"],
               timeout=20, what="the terminal's output in the session's log")

    hog = launch(base, tokens["alice"], {"name": "hog", "command": "python3 -c 'b=[]\nwhile 1: b.append(bytearray(1<<24))'",
                                          "image": TEST_IMAGE, "resources": {"cpu": 1, "mem": "256M"}})
    hog = wait_until(lambda: (s := get_ok(base, f"/api/v1/sessions/{hog['id']}/", tokens["alice"]))["status"]
                     in ("TERMINATED", "ERROR") and s, timeout=60, what="the memory hog to be killed")
    assert "out of memory at its 256 MiB limit" in hog["status_reason"], hog

    client = docker.from_env()
    for session, token in ((alice, tokens["alice"]), (bob, tokens["bob"])):
        status, _ = api(base, "DELETE", f"/api/v1/sessions/{session['id']}/", token)
        assert status in (200, 202, 204)
    # sparse: the list alone, without inspecting each container after it (one removed in between, by this
    # agent or another test's beside it in pytest-xdist, made the inspect fail with 404 NotFound)
    wait_until(lambda: not client.containers.list(all=True, sparse=True, filters={"label": "fgpu.node=docker-node"}),
               timeout=30, what="every session container to be removed")
