"""The fGPU walkthrough's second half in a real browser (issue 16): against the console as `make
run` starts it (standalone, demo-node on the process runtime, whose image "host" the demo gives a
JupyterLab app), launch 0.5 fGPU → open JupyterLab from the session list → a new tab shows
JupyterLab through the console's proxy on the apps origin (make run's port + 1) → a notebook
cell prints CUDA_VISIBLE_DEVICES and runs `!nvidia-smi`, whose output shows the 2048MiB slice
(kernel messages travel over the proxied websocket). JupyterLab runs from this virtualenv (the `test` extra); the token never shows.
Screenshots go to $FGPU_SCREENSHOT_DIR, else <repo>/screenshots/."""
from __future__ import annotations

import json
import re
from urllib.parse import urlsplit

import pytest

from tests.test_browser import ADMIN_PASSWORD, screenshot_dir
from tests.test_browser import console_url, page  # noqa: F401  (fixtures)
from tests.test_browser_session_apps import call
from tests.test_browser_workloads import log_in

pytestmark = pytest.mark.browser
pytest.importorskip("jupyterlab")

CELL = 'import os\nprint("CUDA_VISIBLE_DEVICES =", os.environ["CUDA_VISIBLE_DEVICES"])\n!nvidia-smi'
NOTEBOOK = {"cells": [{"cell_type": "code", "execution_count": None, "id": "walkthrough", "metadata": {},
                       "outputs": [], "source": CELL}],
            "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
            "nbformat": 4, "nbformat_minor": 5}


def run_the_walkthrough_notebook(list_page, row, *, prefix: str, app: str, failed_shot: str):
    """From `row` of the session list (on `list_page`), open app `app` (JupyterLab, served under `prefix`) in a new
    tab, open walkthrough.ipynb (written into the session beforehand), run its cell once the
    kernel is connected (its websocket through the proxy: the status bar says Idle), and wait
    until the output shows the session's device and its 2048MiB slice. Returns (the tab, the
    cell's output); a screenshot named `failed_shot` if the output never comes."""
    from playwright.sync_api import expect

    with list_page.context.expect_page() as opened:
        row.locator(f'a.app-link[data-app="{app}"]').click()
    lab = opened.value
    expect(lab).to_have_url(prefix + "lab", timeout=120_000)
    expect(lab.locator("#jp-main-dock-panel")).to_be_visible(timeout=120_000)
    lab.goto(prefix + "lab/tree/walkthrough.ipynb")
    expect(lab.locator(".jp-Notebook .jp-Cell").first).to_contain_text("CUDA_VISIBLE_DEVICES", timeout=120_000)
    expect(lab.locator(".jp-StatusBar-Widget").filter(has_text="| Idle").first).to_be_visible(timeout=120_000)
    output = lab.locator(".jp-Notebook .jp-OutputArea").first
    try:
        lab.locator(".jp-Notebook .jp-Cell").first.click()
        lab.locator("jp-button[data-command='notebook:run-cell-and-select-next']").click()
        expect(output).to_contain_text("CUDA_VISIBLE_DEVICES = GPU-", timeout=120_000)
        expect(output).to_contain_text("0MiB /   2048MiB", timeout=120_000)
    except AssertionError:
        lab.screenshot(path=str(screenshot_dir() / failed_shot), animations="disabled")
        raise
    return lab, output


def test_a_notebook_opened_from_the_session_list_sees_its_gpu_slice(console_url, page):
    from playwright.sync_api import expect

    base = console_url
    token = call(base, "POST", "/api/v1/auth/token/", {"username": "admin", "password": ADMIN_PASSWORD})[0]["token"]
    session = call(base, "POST", "/api/v1/sessions/", {"name": "notebook", "resources": {"cuda.shares": "0.5"}},
                   token)[0]
    log_in(page, base)
    row = page.locator(f'#sessions-table tr[data-session-id="{session["id"]}"]')
    expect(row.locator("td.status")).to_have_text("RUNNING")
    ran = call(base, "POST", f"/api/v1/sessions/{session['id']}/exec/",
               {"command": ["python3", "-c", f"open('walkthrough.ipynb', 'w').write({json.dumps(json.dumps(NOTEBOOK))})"]},
               token)[0]
    assert ran["exit_code"] == 0, ran

    apps = f"http://localhost:{urlsplit(base).port + 1}"  # make run's apps origin
    lab, output = run_the_walkthrough_notebook(page, row, prefix=f"{apps}/sessions/{session['id']}/apps/jupyter/",
                                               app="jupyter", failed_shot="session-apps-jupyter-failed.png")
    expect(output).to_contain_text("GPU 0 is a 0.50 fGPU slice of CUDA GPU 8192MiB (2048MiB, 20 of 80 SMs = 25%)")
    lab.screenshot(path=str(screenshot_dir() / "session-apps-jupyter-notebook.png"), animations="disabled")

    assert_no_token(lab.content(), page.content())


def assert_no_token(*pages: str) -> None:
    """No app token (48 hex characters, sessions.serving.session_apps) in `pages`: JupyterLab's page config
    carries it masked ("*" as many)."""
    for shown in pages:
        assert re.search(r"(?<![0-9a-f])[0-9a-f]{48}(?![0-9a-f])", shown) is None
