"""The host's view of a node's GPUs (issue 16, item 5): which process of which session holds how
much memory of which GPU. On real GPUs from NVML's running processes (the fake pynvml: NVML is
outside the process), matched to sessions by their process tree; on a mock node each session's
declared use, else its granted slice; asked of a real agent over the channel layer
(`node.processes` on the node's group). The whole path through uvicorn, the admin page and the
docker runtime is in tests/test_browser_jupyter_distributed.py; the CLI's table here, against a
recorded answer of the API."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

import protocol
from agent.usage import UsageSampler
from tests.conftest import GiB, wait_until_async
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml, FakeProcess
from tests.test_agent_runtime import TIMEOUT, run_agent, start_spec

MiB = 1 << 20
UUID_A, UUID_B = "GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000"


@pytest.fixture
def session_leader():
    """A real process leading a process session of its own, as a session's shell does."""
    child = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield child.pid
    child.kill()
    child.wait()


def test_on_real_gpus_nvml_processes_are_matched_to_their_sessions_and_strangers_are_listed_too(session_leader):
    stranger = 4_000_000  # no such pid here: its command comes from NVML's process name
    fake = FakeNvml([
        FakeGpu(uuid=UUID_A, processes=[FakeProcess(pid=session_leader, used_memory=3 * GiB),
                                        FakeProcess(pid=stranger, used_memory=None, name="/opt/miner")],
                graphics_processes=[FakeProcess(pid=session_leader, used_memory=3 * GiB)]),
        FakeGpu(uuid=UUID_B, graphics_processes=[FakeProcess(pid=stranger, used_memory=64 * MiB, name="/opt/miner")]),
    ])
    inventory = {"devices": [{"device_id": UUID_A, "memory_size": 80 * GiB}, {"device_id": UUID_B, "memory_size": 80 * GiB}]}
    running = SimpleNamespace(process=SimpleNamespace(pid=session_leader), work_dir="/nonexistent",
                              env={"CUDA_VISIBLE_DEVICES": UUID_A})
    agent = SimpleNamespace(sessions={"s1": running}, inventory=inventory, mock=False, manager=None, node="n")

    view = UsageSampler(agent, nvml=fake, clock=lambda: 1_764_000_000.5).processes()

    assert view["source"] == "nvml" and view["at"] == 1_764_000_000 and view["truncated"] is False
    assert view["processes"] == [
        {"device": UUID_A, "index": 0, "pid": session_leader, "command": "sleep 60", "session_id": "s1",
         "memory": 3 * GiB, "kind": "compute"},  # computing and drawing: listed once
        {"device": UUID_A, "index": 0, "pid": stranger, "command": "/opt/miner", "session_id": None, "memory": None,
         "kind": "compute"},
        {"device": UUID_B, "index": 1, "pid": stranger, "command": "/opt/miner", "session_id": None,
         "memory": 64 * MiB, "kind": "graphics"},
    ]


def test_a_gpu_nvml_cannot_read_is_left_out_not_guessed(session_leader):
    fake = FakeNvml([FakeGpu(uuid=UUID_A, processes=[FakeProcess(pid=session_leader, used_memory=GiB)])])
    fake.fail("nvmlDeviceGetComputeRunningProcesses", 999)  # NVML_ERROR_UNKNOWN
    inventory = {"devices": [{"device_id": UUID_A, "memory_size": 80 * GiB}, {"device_id": UUID_B, "memory_size": 80 * GiB}]}
    agent = SimpleNamespace(sessions={}, inventory=inventory, mock=False, manager=None, node="n")

    assert UsageSampler(agent, nvml=fake).processes()["processes"] == []  # UUID_B: no such GPU; UUID_A: refused


def test_an_agent_on_a_mock_node_answers_with_each_sessions_slice_or_its_declaration(tmp_path):
    declare = "echo '{\"memory\": \"1536M\"}' > .fgpu-usage && exec sleep 30"

    async def scenario(h):
        whole = await h.start_session(start_spec(command="exec sleep 30", memory_limit=2 * GiB))
        declared = await h.start_session(start_spec(command=declare, shares="0.25", memory_limit=GiB))
        reply = await h.layer.new_channel("test.")

        async def declared_answer():
            await h.layer.group_send(protocol.node_group(h.agent.node),
                                     {"type": protocol.NODE_PROCESSES, "reply_channel": reply})
            answer = await h.layer.receive(reply)
            return answer if {p["session_id"]: p["memory"] for p in answer["processes"]}.get(declared) == 1536 * MiB else None

        # until the program has written its declaration
        answer = await wait_until_async(declared_answer, timeout=TIMEOUT, interval=0.2, what="the declared 1536 MiB")
        pids = {sid: h.agent.sessions[sid].process.command_pid for sid in (whole, declared)}  # in a sandbox: not bwrap
        return whole, declared, pids, answer

    whole, declared, pids, answer = run_agent(tmp_path, scenario)

    assert answer["type"] == protocol.NODE_PROCESSES_RESULT and answer["ok"] and answer["source"] == "declared"
    rows = {p["session_id"]: p for p in answer["processes"]}
    assert rows[whole]["memory"] == 2 * GiB and rows[whole]["pid"] == pids[whole] and rows[whole]["kind"] == "declared"
    assert "sleep 30" in rows[whole]["command"]
    assert rows[declared]["memory"] == 1536 * MiB and rows[declared]["pid"] == pids[declared]
    assert {p["device"] for p in answer["processes"]} == {start_spec()["devices"][0]["device_id"]}


ANSWER = {"node": "gpu-1", "source": "nvml", "at": 1_764_000_000, "truncated": False, "processes": [
    {"device": UUID_A, "index": 0, "model_name": "NVIDIA A100", "pid": 4242, "command": "python3 train.py",
     "memory": 2 * GiB, "kind": "compute",
     "session": {"id": "0b4f6b1e-9d1c-4a43-9f0e-3c5d2f1a7b10", "name": "notebook", "owner": "alice",
                 "status": "RUNNING", "granted_memory": 2 * GiB}},
    {"device": UUID_A, "index": 0, "model_name": "NVIDIA A100", "pid": 999, "command": "/usr/lib/xorg/Xorg",
     "memory": None, "kind": "graphics", "session": None}]}


def test_fgpu_nodes_processes_prints_the_host_view_and_names_a_node_it_cannot_ask(tmp_path):
    """Against a small HTTP server answering as the console does (the CLI is another program)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    import threading

    class Console(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.startswith("/api/v1/nodes/gpu-1/processes/"):
                body, status = ANSWER, 200
            elif self.path.startswith("/api/v1/nodes/gpu-2/processes/"):
                body, status = {"type": "node-timeout", "title": "Agent did not answer", "status": 504,
                                "detail": "the agent on gpu-2 did not answer within 10 s; is the node up?"}, 504
            elif self.path.startswith("/api/v1/nodes/"):
                body, status = {"count": 3, "next": None, "previous": None, "results": [
                    {"name": "gpu-1", "status": "ALIVE"}, {"name": "gpu-2", "status": "ALIVE"},
                    {"name": "gpu-3", "status": "LOST"}]}, 200
            else:
                body, status = {"detail": "not found"}, 404
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Console)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {**os.environ, "FGPU_URL": f"http://127.0.0.1:{server.server_port}", "FGPU_TOKEN": "t",
               "XDG_CONFIG_HOME": str(tmp_path)}
        out = subprocess.run([sys.executable, "-m", "fgpu_cli", "nodes", "--processes"], capture_output=True, text=True,
                             env=env, timeout=60)
    finally:
        server.shutdown()

    assert out.returncode == 1, out.stderr  # one node could not be asked
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["NODE", "GPU", "UUID", "PID", "SESSION", "OWNER", "GPU", "MEMORY", "GRANTED", "SOURCE",
                                "COMMAND"]
    assert lines[1].split() == ["gpu-1", "0", "GPU-aaaa", "4242", "notebook", "alice", "2", "GiB", "2", "GiB", "compute",
                                "python3", "train.py"]
    assert lines[2].split() == ["gpu-1", "0", "GPU-aaaa", "999", "—", "—", "-", "-", "graphics", "/usr/lib/xorg/Xorg"]
    assert "node gpu-3 is LOST" in out.stderr
    assert "fgpu: error: node gpu-2: the agent on gpu-2 did not answer within 10 s" in out.stderr


def test_the_api_is_for_administrators_and_asks_only_a_node_that_is_alive(demo_cluster, staff, alice):
    from accelerators.models import Node, NodeStatus
    from tests.conftest import client_for

    assert client_for(alice).get("/api/v1/nodes/demo-node/processes/").status_code == 403
    missing = client_for(staff).get("/api/v1/nodes/no-such-node/processes/")
    assert missing.status_code == 404
    Node.objects.filter(name="demo-node").update(status=NodeStatus.LOST)
    lost = client_for(staff).get("/api/v1/nodes/demo-node/processes/")
    assert lost.status_code == 409 and lost.json()["type"] == "node-not-alive"
    assert lost.json()["detail"] == "node demo-node is LOST: its agent is not there to ask"
