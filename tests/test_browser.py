"""The user walkthrough in a real browser, against the console exactly as `make run` starts it.

`manage.py standalone` runs in a subprocess (its own SQLite under tmp_path, in-memory channel
layer, eager Celery, the embedded mock node `demo-node` with one 8 GiB GPU = 2 fGPU). Debian's
chromium, driven by Playwright, logs in as admin, launches a 0.5 fGPU session from the dialog,
watches it become RUNNING over the websocket (no reload), runs `nvidia-smi` in the web terminal
and sees the 2 GiB slice (2048MiB), then terminates the session from the list.

Screenshots of the launch dialog, the list, the terminal and the terminate confirmation go to
$FGPU_SCREENSHOT_DIR, else
<repo>/screenshots/.
"""
from __future__ import annotations

import json
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
    # pytest-django's DJANGO_SETTINGS_MODULE (console.settings) would win over standalone's own.
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")}
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
        page.on("pageerror", lambda exc: errors.append(f"uncaught: {exc}"))
        page.on("console", lambda msg: errors.append(f"console.{msg.type}: {msg.text}") if msg.type == "error" else None)
        page.js_errors = errors
        try:
            yield page
        finally:
            context.close()
            browser.close()


def terminal_lines(page) -> list[str]:
    """The rows xterm's DOM renderer shows, right-trimmed."""
    rows = page.locator("#terminal .xterm-rows").evaluate("rows => Array.from(rows.children, row => row.textContent)")
    return [row.replace("\u00a0", " ").rstrip() for row in rows]


def session_frames(frames: list[str], session_id: str) -> list[dict]:
    """The `session` notices about `session_id` among the /ws/sessions/ frames received."""
    found = []
    for frame in frames:
        try:
            message = json.loads(frame)
        except (TypeError, ValueError):
            continue
        if message.get("type") == "session" and (message.get("session") or {}).get("id") == session_id:
            found.append(message["session"])
    return found


def test_walkthrough_launch_a_half_fgpu_session_run_nvidia_smi_and_terminate_it(console_url, page):
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)

    shots = screenshot_dir()
    list_frames: list[str] = []

    def on_websocket(ws):
        if ws.url.endswith("/ws/sessions/"):
            ws.on("framereceived", lambda payload: list_frames.append(payload))

    page.on("websocket", on_websocket)

    # A user opens the console's address and logs in; they land on the session list.
    page.goto(console_url + "/")
    expect(page).to_have_url(re.compile(r"/login/"))
    page.fill("#id_username", "admin")
    page.fill("#id_password", ADMIN_PASSWORD)
    page.click("#login-submit")
    expect(page).to_have_url(console_url + "/sessions/")
    expect(page.locator("#live-indicator")).to_have_attribute("data-state", "live")
    expect(page.locator("#sessions-empty")).to_be_visible()

    # Open the launch dialog and pick 0.5 fGPU with the keyboard (Home = the minimum, one step up).
    page.click("#start-session")
    dialog = page.locator("#launch-dialog")
    expect(dialog).to_be_visible()
    expect(page.locator("#options-status")).to_have_text("")
    slider = page.locator("#fgpu-slider")
    readout = page.locator("#fgpu-readout")
    expect(slider).to_be_enabled()
    slider.fill("2")
    expect(readout).to_have_text("2.00 fGPU")
    slider.focus()
    page.keyboard.press("Home")
    expect(readout).to_have_text("0.25 fGPU")
    page.keyboard.press("ArrowRight")
    expect(slider).to_have_value("0.5")
    expect(readout).to_have_text("0.50 fGPU")
    expect(page.locator("#fgpu-meaning")).to_contain_text("2 GiB")
    expect(page.locator("#launch-error")).to_be_hidden()
    dialog.screenshot(path=str(shots / "launch-dialog.png"), animations="disabled")

    # Launch: the row appears at once and turns RUNNING through the websocket (no reload).
    with page.expect_response(lambda r: r.url.endswith("/api/v1/sessions/") and r.request.method == "POST") as info:
        page.click("#launch-submit")
    created = info.value.json()
    assert info.value.status == 201, created
    assert created["resources"]["cuda.shares"] in ("0.5", "0.50"), created
    session_id = created["id"]
    expect(dialog).to_be_hidden()
    row = page.locator(f'#sessions-table tr[data-session-id="{session_id}"]')
    expect(row.locator("td.configuration")).to_have_text(re.compile(r"^\s*0\.50 fGPU"))
    expect(row.locator("td.status")).to_have_text("RUNNING")
    terminal_link = row.locator("a.terminal-link")
    expect(terminal_link).to_be_visible()
    if created["status"] != "RUNNING":  # then only the websocket can have told the page
        assert "RUNNING" in [s["status"] for s in session_frames(list_frames, session_id)], list_frames
    page.screenshot(path=str(shots / "session-list.png"), animations="disabled")

    # Open the terminal and run nvidia-smi: the session sees its 2 GiB slice.
    terminal_link.click()
    expect(page).to_have_url(console_url + f"/sessions/{session_id}/terminal/")
    expect(page.locator("#terminal-status")).to_have_text("Connected")

    def shell_prompt():
        lines = [line for line in terminal_lines(page) if line]
        return lines and re.search(r"[$#%>]$", lines[-1]) and lines[-1]

    prompt = wait_until(shell_prompt, timeout=20, what="the shell's prompt in the terminal")
    page.locator("#terminal").click()
    page.keyboard.type("nvidia-smi")
    page.keyboard.press("Enter")

    def table_then_prompt():
        lines = [line for line in terminal_lines(page) if line]
        text = "\n".join(lines)
        return "2048MiB" in text and len(lines) > 2 and lines[-1] == prompt and text

    wait_until(table_then_prompt, timeout=30, interval=0.2,
               what="nvidia-smi's table with 2048MiB, then the prompt again")
    page.screenshot(path=str(shots / "terminal.png"), animations="disabled")

    # Back to the list and terminate the session there.
    page.click("a.back-link")
    expect(page).to_have_url(console_url + "/sessions/")
    row = page.locator(f'#sessions-table tr[data-session-id="{session_id}"]')
    expect(row.locator("td.status")).to_have_text("RUNNING")
    row.locator("button.terminate-button").click()
    expect(page.locator("#terminate-dialog")).to_be_visible()
    expect(page.locator("#terminate-name")).to_have_text(created["name"])
    page.screenshot(path=str(shots / "terminate-dialog.png"), animations="disabled")
    page.click("#terminate-confirm")
    expect(page.locator("#terminate-dialog")).to_be_hidden()
    expect(row.locator("td.status")).to_have_text("TERMINATED")
    expect(row.locator("a.terminal-link")).to_have_count(0)
    expect(row.locator("button.terminate-button")).to_have_count(0)

    assert page.js_errors == [], page.js_errors
