"""Concurrent launches from several OS processes against the real distributed stack.

A small cluster of two mock agents (each its own process): `race-a` with two 8 GiB / 80-SM
GPUs and `race-b` with one 4 GiB / 40-SM GPU whose split count is 1; fractional mode with
unit_mem 4 GiB, unit_proc 40, quantum 0.25 (so 2 + 2 + 1 fGPU). Six client processes, each
with its own user's token, are released together by a start file and each POSTs four mixed
requests (fGPU 0.75 or 1.5, HAMi style gpu/gpu_memory/gpu_cores, a Run:ai style fraction) —
24 sessions racing through uvicorn, the Celery manager worker's scheduler passes and the
agents. While they settle, and once they have, no device holds more live allocations than
its memory, SMs and split count allow; every session ends RUNNING or PENDING (a PENDING one
saying why, from a scheduler pass), and each node runs at least one.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from decimal import Decimal

import pytest
from django.db.models import Count, Sum

from tests.conftest import ROOT, StackNode, wait_until
from tests.test_e2e_distributed import VENV_BIN, api

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

REDIS_DB = 11  # its own database (the distributed e2e test uses 7), flushed first
CLIENTS = 6
NODES = {
    # node name → (mock-accelerator.toml devices, device_split_count set once registered)
    "race-a": ([("7ace0000-0000-4000-8000-0000000000a0", "8G", 80), ("7ace0000-0000-4000-8000-0000000000a1", "8G", 80)], 10),
    "race-b": ([("7ace0000-0000-4000-8000-0000000000b0", "4G", 40)], 1),
}
LIVE_WAITING = ("waiting for capacity", "queued behind")  # the reasons a scheduler pass gives

# Each client: signal ready, wait for the go (a byte on its stdin), POST its requests as fast as it can and
# print [(HTTP status, body), …] as JSON. Only the standard library, so it starts quickly.
CLIENT = r"""
import json, sys, urllib.error, urllib.request
base, token, ready, requests = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
def post(body):
    req = urllib.request.Request(base + "/api/v1/sessions/", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": "Token " + token})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")
open(ready, "w").close()
sys.stdin.read(1)  # the go: one byte from the test, to every client at once
print(json.dumps([post(body) for body in requests]))
"""


def mock_toml(devices) -> str:
    """The demo node's mock-accelerator.toml (attributes, formats) with `devices` instead of its one GPU."""
    rows = ",\n".join(
        f'  {{ mother_uuid = "{uuid}", model_name = "CUDA GPU", numa_node = 0, subproc_count = {sms}, '
        f'memory_size = "{memory}", is_mig_device = false }}'
        for uuid, memory, sms in devices)
    demo = (ROOT / "demo" / "mock-accelerator.toml").read_text()
    toml, count = re.subn(r"^devices = \[\n.*?^\]\n", lambda _: f"devices = [\n{rows},\n]\n", demo, flags=re.M | re.S)
    assert count == 1, "demo/mock-accelerator.toml no longer has one `devices = [...]` array"
    return toml


def client_requests(client: int) -> list[dict]:
    shares = "0.75" if client % 2 else "1.5"
    other = "1.5" if client % 2 else "0.75"
    styles = [{"cuda.shares": shares}, {"gpu": 1, "gpu_memory": "3G", "gpu_cores": 30},
              {"gpu_fraction": "0.5"}, {"cuda.shares": other}]
    styles = styles[client % 4:] + styles[:client % 4]  # each client in its own order
    return [{"name": f"c{client}-r{i}", "resources": {**resources, "cpu": 1, "mem": "256M"}}
            for i, resources in enumerate(styles)]


@pytest.fixture(params=["auto", "none"], ids=["cgroup", "scan"])
def race_cluster(distributed_stack, django_user_model, request):
    """The stack with one agent per node of NODES on Redis db REDIS_DB, and CLIENTS users, its
    agents tracking sessions' processes by cgroup or by the /proc scan (agent.toml's
    cgroup-root); returns (the tests.stack.Stack, {username: token})."""
    stack = distributed_stack(redis_db=REDIS_DB, nodes=[
        StackNode(name, mock_toml(devices), cpu_count=32, memory="64G", devices=len(devices), cgroup_root=request.param)
        for name, (devices, _) in NODES.items()])
    tokens = {}
    for i in range(CLIENTS):
        django_user_model.objects.create_user(f"racer{i}", password="racer-pass-123")
        status, body = api(stack.base, "POST", "/api/v1/auth/token/",
                           body={"username": f"racer{i}", "password": "racer-pass-123"})
        assert status == 200, body
        tokens[f"racer{i}"] = body["token"]
    from accelerators.models import Node

    for name, (_, split) in NODES.items():
        Node.objects.filter(name=name).update(device_split_count=split)
    return stack, tokens


def over_commits() -> list[str]:
    """Every device whose live allocations (summed here, not by the code under test) exceed its
    memory, its SMs or its node's split count."""
    from accelerators.models import Device
    from sessions.models import Allocation

    live = {row["device"]: row for row in Allocation.objects.filter(released_at__isnull=True).values("device").annotate(
        memory=Sum("memory"), procs=Sum("procs"), sessions=Count("session", distinct=True))}
    problems = []
    for device in Device.objects.select_related("node"):
        used = live.get(device.pk, {"memory": 0, "procs": 0, "sessions": 0})
        if (used["memory"] > device.memory_size or used["procs"] > device.subproc_count
                or used["sessions"] > device.node.device_split_count):
            problems.append(f"{device.node.name}/{device.device_id}: {used['memory']}/{device.memory_size} B, "
                            f"{used['procs']}/{device.subproc_count} SMs, "
                            f"{used['sessions']}/{device.node.device_split_count} sessions")
    return problems


def test_launches_racing_from_six_processes_never_over_commit_and_settle_running_or_pending(race_cluster, tmp_path):
    from sessions.models import Allocation, ComputeSession, SessionStatus

    stack, tokens = race_cluster
    base = stack.base
    clients = []
    for i, token in enumerate(tokens.values()):
        ready = tmp_path / f"ready-{i}"
        argv = [str(VENV_BIN / "python"), "-c", CLIENT, base, token, str(ready), json.dumps(client_requests(i))]
        clients.append((ready, subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE, text=True)))
    violations: list[str] = []
    results = []
    try:
        wait_until(lambda: all(ready.exists() for ready, _ in clients), timeout=30, what="the clients to be ready")
        for _, client in clients:  # they all go at once
            client.stdin.write("g")
            client.stdin.flush()
        for _, client in clients:
            out, err = client.communicate(timeout=60)
            assert client.returncode == 0, err
            results.extend(json.loads(out))
            violations += over_commits()
    finally:
        for _, client in clients:
            if client.poll() is None:
                client.kill()
                client.wait()
    assert [status for status, _ in results] == [201] * CLIENTS * 4, results

    def settled():
        violations.extend(over_commits())  # checked all along, not only at the end
        sessions = list(ComputeSession.objects.all())
        busy = [s for s in sessions if s.status in (SessionStatus.SCHEDULED, SessionStatus.PREPARING)]
        unseen = [s for s in sessions if s.status == SessionStatus.PENDING and not s.status_reason.startswith(LIVE_WAITING)]
        return len(sessions) == CLIENTS * 4 and not busy and not unseen

    wait_until(settled, timeout=45, interval=0.2, what="every session to be RUNNING or waiting with a reason")
    if ComputeSession.objects.filter(status=SessionStatus.PENDING).exists():
        # A pass in flight could still place a waiting session: one more pass must end (the manager logs a line per
        # pass with pending sessions; beat asks for one every 10 s) and the sessions must still be settled after it.
        def passes_logged() -> int:
            return stack.procs["manager"].output().count("scheduler pass: ")

        seen = passes_logged()
        wait_until(lambda: passes_logged() > seen, timeout=30, what="a scheduler pass to end after the sessions settled")
    assert settled()

    assert violations == []
    assert over_commits() == []
    sessions = list(ComputeSession.objects.select_related("node"))
    assert {s.status for s in sessions} <= {SessionStatus.RUNNING, SessionStatus.PENDING}, \
        [(s.name, s.status, s.status_reason) for s in sessions]
    for session in sessions:
        live = list(Allocation.objects.filter(session=session, released_at__isnull=True).select_related("device__node"))
        if session.status == SessionStatus.PENDING:
            assert session.status_reason.startswith(LIVE_WAITING), (session.name, session.status_reason)
            assert live == [], session.name
        else:
            assert live, session.name
            assert {a.device.node.name for a in live} == {session.node.name}, session.name
            if session.slot_subtype == "shares":
                assert sum(a.shares for a in live) == session.amount, session.name
    running = {name: sum(1 for s in sessions if s.status == SessionStatus.RUNNING and s.node.name == name)
               for name in NODES}
    assert all(running.values()), running
    assert running["race-b"] == 1  # its one device, split count 1
    assert Allocation.objects.filter(released_at__isnull=False).count() == 0
    total = sum((a.shares for a in Allocation.objects.all()), Decimal(0))
    assert total <= Decimal(5)  # 2 + 2 + 1 fGPU
    sys.stderr.write(f"running per node {running}, pending {sum(s.status == 'PENDING' for s in sessions)}, "
                     f"fGPU allocated {total}\n")
