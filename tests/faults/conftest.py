"""The fault-injection harness: tests/stack.py's distributed stack with a private broker.

`fault_stack(nodes=2, gpus=4)` starts a private redis-server, uvicorn, a Celery manager worker,
one beat process and one agent per node (mock GPUs of 8 GiB / 80 SMs: 2 fGPU each with the demo
settings, 64 CPUs and 256 GiB so only the GPUs limit); heartbeats every 2 s, a node LOST after
10 s of silence, a dead manager's messages back after 10 s. Its `kill(name)` / `restart(name)`,
`redis_stop()` / `redis_start()` and `terminate_backends()` inject the faults; an agent's
process is named `agent-<node>`.
"""
from __future__ import annotations

import sys

import pytest

from tests.stack import Stack, StackNode, mock_inventory


@pytest.fixture
def fault_stack(tmp_path, request):
    """Start the stack: `fault_stack(nodes=2, gpus=4, env=None)` → Stack, once every node is ALIVE;
    `env`: more variables for every process (e.g. FGPU_FENCE_TIMEOUT_SECONDS)."""
    stacks: list[Stack] = []

    def start(*, nodes: int = 2, gpus: int = 4, env: dict | None = None) -> Stack:
        stack = Stack(nodes=[StackNode(f"fault-node-{i}", mock_inventory(gpus=gpus), cpu_count=64, memory="256G",
                                       devices=gpus, scratch_retention=0) for i in range(nodes)],
                      work_dir=tmp_path / "stack", env={"FGPU_HEARTBEAT_TIMEOUT": "10",
                                                        "FGPU_BROKER_VISIBILITY_TIMEOUT": "10", **(env or {})})
        stacks.append(stack)
        return stack.start()

    yield start
    report = getattr(request.node, "rep_call", None)
    for stack in stacks:
        if report is not None and report.failed:
            sys.stderr.write(stack.logs()[-20000:])
        stack.close()


@pytest.fixture
def alice_token(django_user_model) -> str:
    """A user's login token, for the clients of the fault and load tests."""
    from accounts.services import login_token_issue

    return login_token_issue(user=django_user_model.objects.create_user("alice"))
