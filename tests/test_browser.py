"""The user walkthrough in a real browser, against the console exactly as `make run` starts it.

`manage.py standalone` runs in a subprocess (its own SQLite under tmp_path, in-memory channel
layer, eager Celery, the embedded mock node `demo-node` with one 8 GiB GPU = 2 fGPU). Debian's
chromium, driven by Playwright, logs in as admin, launches a 0.5 fGPU session from the dialog,
watches it become RUNNING over the websocket (no reload), runs `nvidia-smi` in the web terminal
and sees the 2 GiB slice (2048MiB), then terminates the session from the list.

Screenshots of the dialog, the list and the terminal go to $FGPU_SCREENSHOT_DIR, else
<repo>/screenshots/.
"""
from __future__ import annotations

import os
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port, wait_until

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ADMIN_PASSWORD = "walkthrough-password"
TIMEOUT_MS = 30_000


def screenshot_dir() -> Path:
    path = Path(os.environ.get("FGPU_SCREENSHOT_DIR") or ROOT / "screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture
def console_url(procs, tmp_path):
    """A standalone console on a free port; its URL once the login page answers."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(FGPU_DATA_DIR=str(tmp_path / "data"), FGPU_ADMIN_PASSWORD=ADMIN_PASSWORD, PORT=str(port),
               PYTHONUNBUFFERED="1")
    server = procs.start("standalone", [sys.executable, "manage.py", "standalone"], env)
    base = f"http://127.0.0.1:{port}"

    def ready():
        assert server.popen.poll() is None, f"standalone exited:\n{server.output()}"
        return "fGPU Console is serving on" in server.output() and answers(base + "/login/")

    wait_until(ready, timeout=60, interval=0.2, what="the standalone console to serve /login/")
    return base


@pytest.fixture
def page():
    sync_api = pytest.importorskip("playwright.sync_api")
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1280, "height": 800})
        context.set_default_timeout(TIMEOUT_MS)
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.js_errors = errors
        try:
            yield page
        finally:
            context.close()
            browser.close()


def terminal_text(page) -> str:
    """What xterm's DOM renderer shows, one line per row."""
    return page.locator("#terminal .xterm-rows").evaluate(
        "rows => Array.from(rows.children, row => row.textContent).join('\\n')")


def test_walkthrough_launch_a_half_fgpu_session_run_nvidia_smi_and_terminate_it(console_url, page):
    from playwright.sync_api import expect

    shots = screenshot_dir()

    # Log in.
    page.goto(console_url + "/sessions/")
    expect(page).to_have_url(re.compile(r"/login/"))
    page.fill("#id_username", "admin")
    page.fill("#id_password", ADMIN_PASSWORD)
    page.click("#login-submit")
    expect(page).to_have_url(re.compile(r"/sessions/$"))
    expect(page.locator("#live-indicator")).to_have_attribute("data-state", "live")

    # Open the launch dialog and ask for 0.5 fGPU.
    page.click("#start-session")
    dialog = page.locator("#launch-dialog")
    expect(dialog).to_be_visible()
    expect(page.locator("#options-status")).to_have_text("")
    slider = page.locator("#fgpu-slider")
    expect(slider).to_be_enabled()
    slider.fill("0.5")
    expect(slider).to_have_value("0.5")
    expect(page.locator("#fgpu-readout")).to_have_text("0.50 fGPU")
    expect(page.locator("#launch-error")).to_be_hidden()
    dialog.screenshot(path=str(shots / "launch-dialog.png"))
    page.screenshot(path=str(shots / "launch-dialog-page.png"))

    # Launch; the row appears and turns RUNNING live (no reload).
    page.click("#launch-submit")
    expect(dialog).to_be_hidden()
    row = page.locator("#sessions-table tr[data-session-id]").filter(
        has=page.locator("td.configuration", has_text=re.compile(r"^\s*0\.50 fGPU")))
    expect(row).to_have_count(1)
    session_id = row.get_attribute("data-session-id")
    row = page.locator(f'#sessions-table tr[data-session-id="{session_id}"]')
    expect(row.locator("td.status")).to_have_text("RUNNING")
    terminal_link = row.locator("a.terminal-link")
    expect(terminal_link).to_be_visible()
    page.screenshot(path=str(shots / "session-list.png"))

    # Open the terminal and run nvidia-smi: the session sees its 2 GiB slice.
    terminal_link.click()
    expect(page).to_have_url(re.compile(rf"/sessions/{session_id}/terminal/$"))
    expect(page.locator("#terminal-status")).to_have_text("Connected")
    expect(page.locator("#terminal .xterm-rows")).to_contain_text(re.compile(r"\S"))  # the shell's prompt
    page.locator("#terminal").click()
    page.keyboard.type("nvidia-smi")
    page.keyboard.press("Enter")
    wait_until(lambda: "2048MiB" in terminal_text(page), timeout=30, interval=0.2,
               what="nvidia-smi's table with 2048MiB in the terminal")
    page.screenshot(path=str(shots / "terminal.png"))

    # Back to the list and terminate it there.
    page.click("a.back-link")
    expect(page).to_have_url(re.compile(r"/sessions/$"))
    row = page.locator(f'#sessions-table tr[data-session-id="{session_id}"]')
    expect(row.locator("td.status")).to_have_text("RUNNING")
    row.locator("button.terminate-button").click()
    expect(page.locator("#terminate-dialog")).to_be_visible()
    page.click("#terminate-confirm")
    expect(page.locator("#terminate-dialog")).to_be_hidden()
    expect(row.locator("td.status")).to_have_text("TERMINATED")
    expect(row.locator("a.terminal-link")).to_have_count(0)
    expect(row.locator("button.terminate-button")).to_have_count(0)

    assert page.js_errors == [], page.js_errors
