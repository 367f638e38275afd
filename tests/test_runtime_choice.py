"""Which runtime `make run` picks (issue 31, "Isolated by default"): `manage.py standalone` with
FGPU_RUNTIME=auto (its default) runs sessions in Docker containers where Docker Engine answers and
holds the session image, else as processes, and says which and why when it starts; a missing image
is named with the command that builds it. Real standalone processes, real Docker Engine, the image
of tests/images/build.sh; each test's node has a name of its own, and what its agent created (its
containers, its network and iptables chain, agent.network) is gone once the console stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from tests.conftest import ROOT, free_port, wait_until
from tests.docker_nodes import remove_leftovers
from tests.test_browser import answers
from tests.test_e2e_distributed import api, get_ok

pytestmark = pytest.mark.e2e
TEST_IMAGE = "fgpu-session:test"  # tests/images/build.sh
ADMIN_PASSWORD = "runtime-choice-123"


def agent_toml(tmp_path, node: str, image: str) -> str:
    path = tmp_path / f"{node}.toml"
    path.write_text(
        f'[agent]\nid = "{node}"\nallowed-compute-plugins = ["ai.backend.accelerator.mock"]\ncpu-count = 2\n'
        f'memory = "4G"\n[container]\ndefault-image = "{image}"\n'
        f'[plugins.mock]\nconfig = "{ROOT / "demo" / "mock-accelerator.toml"}"\n'
    )
    return str(path)


def standalone_env(tmp_path, node: str, image: str, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")}
    env.update(FGPU_DATA_DIR=str(tmp_path / "data"), FGPU_ADMIN_PASSWORD=ADMIN_PASSWORD, PORT=str(free_port()),
               PYTHONUNBUFFERED="1", FGPU_AGENT_CONFIG=agent_toml(tmp_path, node, image), FGPU_RUNTIME="auto", **extra)
    return env


def serve(procs, env):
    """Start standalone; (its process, its base URL) once it serves."""
    server = procs.start("standalone", [sys.executable, "manage.py", "standalone"], env)
    base = f"http://127.0.0.1:{env['PORT']}"

    def ready():
        assert server.popen.poll() is None, f"standalone exited:\n{server.output()}"
        return "fGPU Console is serving on" in server.output() and answers(base + "/login/")

    wait_until(ready, timeout=90, interval=0.2, what="the standalone console to serve")
    return server, base


@pytest.fixture
def node():
    """A node name of this test's own; its containers and networks are removed at the end whatever happened."""
    pytest.importorskip("docker")
    name = f"choice-{uuid.uuid4().hex[:8]}"
    yield name
    remove_leftovers(name)


def test_auto_picks_docker_where_docker_engine_answers_and_holds_the_image_and_says_so(procs, tmp_path, node):
    import docker

    client = docker.from_env()
    server, base = serve(procs, standalone_env(tmp_path, node, TEST_IMAGE))
    said = server.output()
    assert f"Sessions run in Docker containers (image {TEST_IMAGE}): Docker Engine answers at unix://" in said, said

    status, body = api(base, "POST", "/api/v1/auth/token/", body={"username": "admin", "password": ADMIN_PASSWORD})
    assert status == 200, body
    token = body["token"]
    status, created = api(base, "POST", "/api/v1/sessions/", token,
                          {"name": "boxed", "resources": {"cuda.shares": "0.5", "cpu": 1, "mem": "256M"}})
    assert status == 201, created
    wait_until(lambda: get_ok(base, f"/api/v1/sessions/{created['id']}/", token)["status"] == "RUNNING",
               timeout=60, what="the session to run")
    containers = client.containers.list(filters={"label": f"fgpu.node={node}"})
    assert [c.labels["fgpu.session"] for c in containers] == [created["id"]]
    networks = client.networks.list(filters={"label": f"fgpu.node={node}"})
    assert [n.name for n in networks] == [next(iter(containers[0].attrs["NetworkSettings"]["Networks"]))]

    server.stop()
    assert not client.containers.list(all=True, filters={"label": f"fgpu.node={node}"})
    assert not client.networks.list(filters={"label": f"fgpu.node={node}"})  # and with it its iptables chain:
    rules = subprocess.run(["iptables", "-S"], capture_output=True, text=True).stdout
    assert f"FGPU-{networks[0].attrs['Labels']['fgpu.instance']}" not in rules


def test_auto_without_the_session_image_says_how_to_build_it_and_runs_sessions_as_processes(procs, tmp_path, node):
    missing = f"fgpu-session:absent-{uuid.uuid4().hex[:8]}"
    server, base = serve(procs, standalone_env(tmp_path, node, missing))
    said = server.output()
    assert f"the session image {missing} is not on this machine: `sudo make image` builds it" in said, said
    assert "This start runs sessions as processes on this machine (the process runtime)." in said
    assert "Sessions run in Docker containers" not in said


def test_auto_where_docker_engine_does_not_answer_runs_sessions_as_processes_and_says_why(procs, tmp_path, node):
    socket = tmp_path / "no-docker.sock"
    server, _ = serve(procs, standalone_env(tmp_path, node, TEST_IMAGE, DOCKER_HOST=f"unix://{socket}"))
    said = server.output()
    assert ("Sessions run as processes on this machine (the process runtime): Docker Engine does not answer at "
            f"unix://{socket}") in said, said


@pytest.mark.parametrize("runtime, expected", [
    ("docker", "FGPU_RUNTIME=docker: Docker Engine does not answer at unix://"),
    ("containers", "FGPU_RUNTIME='containers': expected one of auto, process, docker"),
])
def test_an_explicit_runtime_that_cannot_be_had_stops_standalone_with_the_reason(tmp_path, node, runtime, expected):
    env = standalone_env(tmp_path, node, TEST_IMAGE, DOCKER_HOST=f"unix://{tmp_path / 'no-docker.sock'}")
    env["FGPU_RUNTIME"] = runtime
    done = subprocess.run([sys.executable, "manage.py", "standalone"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert expected in done.stderr and "Traceback" not in done.stderr, done.stderr
