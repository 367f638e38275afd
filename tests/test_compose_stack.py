"""compose.yaml started for real (issue 37.5): `docker-compose up` (Debian's docker-compose 1.x) brings up
postgres, redis, migrate, web, manager, beat and the agent on the docker runtime, from images this machine
builds without a registry (tests/images/build-compose.sh: the Dockerfile's base, PostgreSQL and Redis from
Debian's packages; tests/images/build.sh: the session image), selected as README's "Compose" says
(FGPU_BASE_IMAGE, FGPU_POSTGRES_IMAGE, FGPU_REDIS_IMAGE). The test walks README's walkthrough through REST
and the terminal websocket as a user would: the admin's token from FGPU_ADMIN_PASSWORD (deploy/make_env.py),
a session launched, RUNNING, `echo hi` typed in its terminal and read back, terminated.

The stack runs under a project name of its own (fgpu-h3-<random>) with its .env and Redis ACL file in the
test's temporary folder (an override file mounts that ACL file), the web published on free ports of this
host's loopback; Prometheus and Grafana (images from a registry) are not started. Whatever happens, the
stack is taken down with its volumes, its images kept (cached by content and by Docker's layer cache).
compose.yaml fixes its network's subnet (10.213.77.0/24, deploy/agent.toml), so one such stack runs on a
host at a time. Run it alone: `pytest -m compose`."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.stack import ROOT, free_port, wait_until
from tests.test_e2e_distributed import api, get_ok, terminal_run

pytestmark = [pytest.mark.e2e, pytest.mark.docker, pytest.mark.compose]
COMPOSE = shutil.which("docker-compose")
SERVICES = ["postgres", "redis", "migrate", "web", "manager", "beat", "agent"]  # not prometheus, grafana: registry images
CI_IMAGES = {
    "FGPU_BASE_IMAGE": "fgpu-compose-base:bookworm",
    "FGPU_POSTGRES_IMAGE": "fgpu-compose-postgres:15",
    "FGPU_REDIS_IMAGE": "fgpu-compose-redis:7",
}  # tests/images/build-compose.sh
NODE = "compose-node"  # deploy/agent.toml
STATE = Path("/var/lib/fgpu-compose")  # compose.yaml's agent: sessions' homes and data folders, on the host


def run(argv: list[str], *, env: dict | None = None, timeout: float = 900) -> str:
    """Run a command with its output shown (pytest -s) and kept; AssertionError naming it if it fails."""
    started = time.monotonic()
    out = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    print(f"$ {' '.join(argv)}  ({time.monotonic() - started:.0f} s)\n{out.stdout[-4000:]}", file=sys.stderr)
    assert out.returncode == 0, f"{' '.join(argv)} exited {out.returncode}:\n{out.stdout[-4000:]}"
    return out.stdout


class Compose:
    """docker-compose on compose.yaml under one project name, with the test's .env and override file."""

    def __init__(self, where: Path):
        self.project = f"fgpu-h3-{secrets.token_hex(4)}"
        self.web_port, self.apps_port = free_port(), free_port()
        # This process's environment without the console's variables (compose substitutes from both), and
        # what the test chooses: the CI images, the web's ports on the loopback, the apps origin on the second.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("FGPU_", "DATABASE_URL", "REDIS_URL"))}
        self.env |= CI_IMAGES | {
            "FGPU_WEB_PORT": f"127.0.0.1:{self.web_port}",
            "FGPU_APPS_ORIGIN_PORT": f"127.0.0.1:{self.apps_port}",
            "FGPU_APPS_ORIGIN": f"http://localhost:{self.apps_port}",
        }
        self.env_file, self.acl_file, self.override = where / ".env", where / "users.acl", where / "override.yaml"
        # Redis's ACL file from the test's folder, not the checkout's deploy/redis/users.acl (compose merges
        # volumes by their path in the container). And, for now, a key of the agent's own that signs nothing:
        # console/celery.py's worker_init check stops every Celery worker without FGPU_SECRET_KEY, the agent's
        # embedded one too (seen here at the agent's first start in compose; README says the agent needs none).
        self.override.write_text(
            f"services:\n  redis:\n    volumes:\n      - {self.acl_file}:/etc/redis/users.acl:ro\n"
            f"  agent:\n    environment:\n      FGPU_SECRET_KEY: {secrets.token_urlsafe(48)}\n"
        )
        self.base = f"http://127.0.0.1:{self.web_port}"

    def argv(self, *args: str) -> list[str]:
        assert COMPOSE
        return [
            COMPOSE,
            "--project-name",
            self.project,
            "--env-file",
            str(self.env_file),
            "-f",
            str(ROOT / "compose.yaml"),
            "-f",
            str(self.override),
            *args,
        ]

    def __call__(self, *args: str, timeout: float = 900) -> str:
        return run(self.argv(*args), env=self.env, timeout=timeout)

    def variables(self) -> dict[str, str]:
        return dict(line.split("=", 1) for line in self.env_file.read_text().splitlines() if line and line[0] != "#")


def image_id(name: str) -> str:
    """The id of the image tagged `name`, or "" when there is none."""
    out = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", name], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def node_leftovers() -> tuple[list, list]:
    """(containers, networks) the compose agent's docker runtime made on this host (node compose-node)."""
    import docker

    client = docker.from_env()
    containers = client.containers.list(all=True, filters={"label": f"fgpu.node={NODE}"})
    # By the agent's label, not the name's prefix: test_compose_network's nodes are compose-node-<hex>, whose
    # networks (fgpu-compose-node-<hex>-…) began with this node's prefix when it ran beside it (pytest-xdist).
    networks = client.networks.list(filters={"label": f"fgpu.node={NODE}"})
    return containers, networks


@pytest.fixture
def stack(tmp_path):
    """The compose stack, up, with the web answering; taken down with its volumes at the end, and what its
    agent left on the host (session containers and networks of node compose-node) removed."""
    if COMPOSE is None:
        pytest.fail("docker-compose is not installed (Debian's docker-compose; .ci/run installs it)")
    state_existed = STATE.exists()
    before = node_leftovers()
    assert before == ([], []), f"another compose-node's containers or networks are on this host: {before}"
    timings = {}
    started = time.monotonic()
    run([str(ROOT / "tests" / "images" / "build.sh")])  # the session image agent.toml's default-image names
    run([str(ROOT / "tests" / "images" / "build-compose.sh")])
    timings["base images"] = time.monotonic() - started
    made = subprocess.run(
        [
            sys.executable,
            str(ROOT / "deploy" / "make_env.py"),
            "--env-file",
            str(tmp_path / ".env"),
            "--acl-file",
            str(tmp_path / "users.acl"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert made.returncode == 0, made.stderr
    compose = Compose(tmp_path)
    try:
        started = time.monotonic()
        replaced = image_id("fgpu-console")
        compose("build", "web")  # one image for every process (compose.yaml's x-app): built once
        if replaced and replaced != image_id("fgpu-console"):  # the build it replaced, untagged now: not kept
            subprocess.run(["docker", "rmi", replaced], capture_output=True, timeout=120)
        timings["console image"] = time.monotonic() - started
        started = time.monotonic()
        compose("up", "--detach", "--no-build", *SERVICES)
        wait_until(lambda: _answers(compose.base), timeout=120, interval=1, what="the web to answer")
        timings["up"] = time.monotonic() - started
        yield compose, timings
    finally:
        # The services' last lines, shown by pytest when the test failed.
        logs = subprocess.run(
            compose.argv("logs", "--no-color", "--tail", "60", *SERVICES[1:]),
            env=compose.env,
            cwd=ROOT,
            timeout=120,
            capture_output=True,
            text=True,
        )
        print(logs.stdout, logs.stderr, file=sys.stderr)
        compose("down", "--volumes", "--remove-orphans", "--timeout", "20", timeout=300)
        containers, networks = node_leftovers()
        for container in containers:
            container.remove(force=True)
        for network in networks:
            network.remove()
        if not state_existed:  # the sessions' homes and data folders this stack made on the host
            shutil.rmtree(STATE, ignore_errors=True)
        print("timings:", {k: round(v) for k, v in timings.items()}, file=sys.stderr)


def _answers(base: str) -> bool:
    """True when something answers HTTP at `base` (a refused or reset connection is not yet the web)."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(base + "/api/v1/", timeout=5)
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def test_compose_up_starts_the_stack_and_a_user_launches_a_docker_session_types_in_its_terminal_and_ends_it(stack):
    compose, timings = stack
    base = compose.base
    started = time.monotonic()
    status, body = api(
        base, "POST", "/api/v1/auth/token/", body={"username": "admin", "password": compose.variables()["FGPU_ADMIN_PASSWORD"]}
    )
    assert status == 200, body
    token = body["token"]
    wait_until(
        lambda: (node := api(base, "GET", f"/api/v1/nodes/{NODE}/", token))[0] == 200 and node[1]["status"] == "ALIVE",
        timeout=120,
        interval=0.5,
        what="the compose agent's node to be ALIVE",
    )

    # The session image the docker agent runs (deploy/agent.toml's default-image), registered as the default
    # by the admin as README's "Images" says: the migration's default, `host`, is the process runtime's.
    status, image = api(base, "POST", "/api/v1/images/", token, {"reference": "fgpu-session:latest", "is_default": True})
    assert status == 201, image
    status, created = api(
        base,
        "POST",
        "/api/v1/sessions/",
        token,
        {"name": "compose-walk", "resources": {"cuda.shares": "0.5", "cpu": 1, "mem": "1G"}},
    )
    assert status == 201, created
    session = wait_until(
        lambda: (
            (s := get_ok(base, f"/api/v1/sessions/{created['id']}/", token))["status"] in ("RUNNING", "TERMINATED", "ERROR") and s
        ),
        timeout=120,
        interval=0.5,
        what="the session to start",
    )
    assert session["status"] == "RUNNING", session
    containers, _ = node_leftovers()
    assert len(containers) == 1, containers  # the session runs as a container of the host's Docker Engine

    status, ticket = api(base, "POST", f"/api/v1/sessions/{session['id']}/terminal-ticket/", token, {})
    assert status == 200, ticket
    # `echo h""i` prints hi; the terminal's echo of the typed line shows h""i, so "hi" is the command's output.
    output = asyncio.run(terminal_run(base.replace("http://", "ws://") + ticket["url"], 'echo h""i\r', "hi\r\n", timeout=30))
    assert 'echo h""i' in output, output

    status, _ = api(base, "DELETE", f"/api/v1/sessions/{session['id']}/", token)
    assert status in (200, 202, 204)
    wait_until(
        lambda: get_ok(base, f"/api/v1/sessions/{session['id']}/", token)["status"] == "TERMINATED",
        timeout=60,
        interval=0.5,
        what="the session to be TERMINATED",
    )
    wait_until(lambda: node_leftovers()[0] == [], timeout=30, interval=0.5, what="the session's container to be removed")
    timings["walkthrough"] = time.monotonic() - started
