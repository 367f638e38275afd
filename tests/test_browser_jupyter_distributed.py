"""The fGPU walkthrough's second half in a real browser on the distributed stack (issue 16): web
(uvicorn), a Celery manager and a docker node's agent as separate processes against PostgreSQL and
Redis. The session runs in a container of the Debian test image (tests/images/build.sh), which
carries JupyterLab and Backend.AI's label `ai.backend.service-ports=jupyterlab:http:8090`; the
image record is registered without apps and takes its JupyterLab app from that label, as the docker
node's agent reports it.

Launch 0.5 fGPU in the test image → open JupyterLab from the session list → a new tab shows
JupyterLab through the web process's proxy, which reaches the app through the agent's relay
(agent.toml `app-relay = true`: the agent's own address, as web hosts on another host would; the
kernel's websocket through it too; checked in the agent's log) → a notebook cell prints CUDA_VISIBLE_DEVICES and runs `!nvidia-smi`,
whose output shows the 2048MiB slice (kernel messages over the proxied websocket). Then the
walkthrough's last step: the node's admin page, `fgpu nodes --processes` and
GET /api/v1/nodes/<name>/processes/ show the host's view: the session's container process
(its host pid) holding its 2 GiB of the GPU. The app's token appears in no page. Screenshots go
to $FGPU_SCREENSHOT_DIR, else <repo>/screenshots/."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sessions.service_ports import SERVICE_PORTS_LABEL
from tests.conftest import ROOT, wait_until
from tests.test_browser import ADMIN_PASSWORD, screenshot_dir
from tests.test_browser import page  # noqa: F401  (fixture)
from tests.test_browser_jupyter import NOTEBOOK, assert_no_token, run_the_walkthrough_notebook
from tests.test_browser_workloads import log_in
from tests.test_e2e_distributed import api, get_ok
from tests.test_session_apps_e2e import BridgedDockerNode


class RelayedDockerNode(BridgedDockerNode):
    """A docker node whose agent relays its containers' apps on its app-address (agent.toml
    `app-relay = true`): the path web hosts take that cannot reach the node's bridge network."""

    def agent_toml(self) -> str:
        return super().agent_toml().replace('[container]\n', '[container]\napp-relay = true\napp-address = "127.0.0.1"\n')

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.docker, pytest.mark.django_db(transaction=True)]

REDIS_DB = 7  # shared with the other distributed e2e tests (they run one after another), flushed first
TEST_IMAGE = "fgpu-session:test"


@pytest.fixture
def stack(distributed_stack, django_user_model):
    """The stack with an administrator and the test image registered without apps (set up before
    the browser starts: Playwright's loop in this thread keeps the ORM out afterwards)."""
    from sessions.models import SessionImage

    django_user_model.objects.create_superuser("admin", password=ADMIN_PASSWORD)
    SessionImage.objects.create(reference=TEST_IMAGE, accelerators=["cuda"])  # no apps of its own
    return distributed_stack(nodes=[RelayedDockerNode("docker-lab", (ROOT / "demo" / "mock-accelerator.toml").read_text(),
                                                      runtime="docker")], redis_db=REDIS_DB)


def test_a_notebook_in_a_container_on_the_distributed_stack_sees_its_slice_and_the_host_sees_its_process(
        stack, page):  # noqa: F811
    from playwright.sync_api import expect

    base = stack.base
    _, body = api(base, "POST", "/api/v1/auth/token/", body={"username": "admin", "password": ADMIN_PASSWORD})
    token = body["token"]

    def registered_label():
        image = next(i for i in get_ok(base, "/api/v1/images/", token)["results"] if i["reference"] == TEST_IMAGE)
        return image["labels"].get(SERVICE_PORTS_LABEL) == "jupyterlab:http:8090" and image["apps"] == []

    wait_until(registered_label, timeout=60, what="the docker node's report to give the image its service-ports label")
    status, session = api(base, "POST", "/api/v1/sessions/", token, {
        "name": "notebook", "image": TEST_IMAGE, "resources": {"cuda.shares": "0.5", "mem": "1G"}})
    assert status == 201, session
    assert [a["name"] for a in session["apps"]] == ["jupyterlab"], session["apps"]
    wait_until(lambda: get_ok(base, f"/api/v1/sessions/{session['id']}/", token)["status"] == "RUNNING", timeout=120,
               what="the container session to run")
    status, ran = api(base, "POST", f"/api/v1/sessions/{session['id']}/exec/", token, {
        "command": ["python3", "-c", f"open('walkthrough.ipynb', 'w').write({json.dumps(json.dumps(NOTEBOOK))})"]})
    assert status == 200 and ran["exit_code"] == 0, ran

    log_in(page, base)
    row = page.locator(f'#sessions-table tr[data-session-id="{session["id"]}"]')
    expect(row.locator("td.status")).to_have_text("RUNNING")
    prefix = f"{stack.apps_base}/sessions/{session['id']}/apps/jupyterlab/"  # the apps origin
    lab, output = run_the_walkthrough_notebook(page, row, prefix=prefix, app="jupyterlab",
                                               failed_shot="jupyter-distributed-failed.png")
    expect(output).to_contain_text("GPU 0 is a 0.50 fGPU slice of CUDA GPU 8192MiB (2048MiB, 20 of 80 SMs = 25%)")
    lab.screenshot(path=str(screenshot_dir() / "jupyter-distributed-notebook.png"), animations="disabled")

    assert "relaying app jupyterlab of session" in stack.procs["agent-docker-lab"].output()

    # The host's view: the session's container (its init, by its host pid) holds its 2 GiB slice.
    container = subprocess.run(["docker", "ps", "-q", "--filter", f"label=fgpu.session={session['id']}"],
                               capture_output=True, text=True, check=True).stdout.split()
    assert len(container) == 1, container
    container_pid = int(subprocess.run(["docker", "inspect", "--format", "{{.State.Pid}}", container[0]],
                                       capture_output=True, text=True, check=True).stdout)
    view = get_ok(base, "/api/v1/nodes/docker-lab/processes/", token)
    assert view["source"] == "declared" and view["node"] == "docker-lab"
    mine = [p for p in view["processes"] if (p["session"] or {}).get("id") == session["id"]]
    assert len(mine) == 1, view
    assert mine[0]["pid"] == container_pid and mine[0]["memory"] == 2 * 2**30
    assert mine[0]["session"]["granted_memory"] == 2 * 2**30 and mine[0]["session"]["owner"] == "admin"

    node = get_ok(base, "/api/v1/nodes/docker-lab/", token)
    page.bring_to_front()
    page.goto(f"{base}/admin/accelerators/node/{node['id']}/change/")
    table = page.locator("#node-processes table.node-processes")
    expect(table.locator(f'tr[data-pid="{container_pid}"]')).to_contain_text("notebook")
    expect(table.locator(f'tr[data-pid="{container_pid}"] td.memory')).to_have_text("2 GiB")
    page.locator("#node-processes").scroll_into_view_if_needed()
    page.screenshot(path=str(screenshot_dir() / "jupyter-distributed-node-processes.png"), full_page=True)

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("FGPU_")}, "FGPU_URL": base, "FGPU_TOKEN": token}
    listed = subprocess.run([sys.executable, "-m", "fgpu_cli", "nodes", "--processes"], capture_output=True, text=True,
                            env=env, timeout=60, cwd=ROOT)
    assert listed.returncode == 0, listed.stderr
    line = next(x for x in listed.stdout.splitlines() if x.startswith("docker-lab"))
    assert line.split()[3:9] == [str(container_pid), "notebook", "admin", "2", "GiB", "2"], listed.stdout

    assert_no_token(lab.content(), page.content())
