"""The session's page in a real browser (issue 36.2), against the console as `make run` starts it:
the terminal leads and fills the viewport at 1440×900 with usage and files beside it; on a
phone (390 px) the app buttons sit under the title, never over the status badge, and the
terminal comes first; the view follows 200,000 lines of output to its last line and the prompt;
a batch session shows its command and its output as a log, keys typed there go nowhere and a
line sent from its input form reaches the program; an ended session leads with how it ended
and shows its log.

Screenshots go to $FGPU_SCREENSHOT_DIR (else <repo>/screenshots/) as session-page-*.png."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

from tests.conftest import wait_until
from tests.test_browser import ADMIN_PASSWORD, TIMEOUT_MS, console_url, page, screenshot_dir, terminal_lines  # noqa: F401

pytestmark = pytest.mark.browser


def api(base: str, method: str, path: str, body: dict | None = None, token: str | None = None) -> dict:
    request = urllib.request.Request(
        base + path,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **({"Authorization": f"Token {token}"} if token else {})},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read() or b"{}")


def shown(tab) -> list[str]:
    """The terminal's non-empty rows on screen."""
    return [line for line in terminal_lines(tab) if line]


def last(tab) -> str:
    return (shown(tab) or [""])[-1]


def box(tab, selector: str) -> dict:
    found = tab.locator(selector).bounding_box()
    assert found, f"{selector} is not laid out"
    return found


def test_the_session_page_leads_with_the_terminal_follows_output_to_its_end_and_shows_batch_and_ended_sessions(console_url, page):  # noqa: F811
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    shots = screenshot_dir()
    token = api(console_url, "POST", "/api/v1/auth/token/", {"username": "admin", "password": ADMIN_PASSWORD})["token"]
    shell = api(console_url, "POST", "/api/v1/sessions/", {"name": "shell", "resources": {"cuda.shares": "0.5"}}, token)
    job = api(
        console_url,
        "POST",
        "/api/v1/sessions/",
        {
            "name": "job",
            "resources": {"cuda.shares": "0.5"},
            "command": "echo epoch 1 done; read -p 'continue? ' answer; echo you said $answer; sleep 600",
        },
        token,
    )
    for s in (shell, job):
        wait_until(
            lambda s=s: api(console_url, "GET", f"/api/v1/sessions/{s['id']}/", token=token)["status"] == "RUNNING",
            timeout=60,
            what=f"{s['name']} RUNNING",
        )

    page.set_viewport_size({"width": 1440, "height": 900})
    page.goto(console_url + "/login/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", ADMIN_PASSWORD)
    page.click("#login-submit")
    expect(page).to_have_url(console_url + "/sessions/")

    # Desktop: the terminal fills the viewport below a compact header; usage and files beside it.
    page.goto(console_url + shell["terminal_url"])
    expect(page.locator("#terminal-status")).to_have_text("Connected")
    expect(page.locator("#session-page")).to_have_attribute("data-phase", "running")
    terminal, side = box(page, ".terminal-shell"), box(page, ".session-side")
    assert terminal["y"] < 200 and terminal["y"] + terminal["height"] > 860, terminal
    assert side["x"] >= terminal["x"] + terminal["width"], (side, terminal)
    rows = int(page.locator("#terminal-size").inner_text().split("×")[1])
    assert rows >= 30, rows  # it had 16 beside a usage panel above it

    shown_prompt = wait_until(lambda: re.search(r"[$#]$", last(page)) and last(page), timeout=20, what="the prompt")
    page.locator("#terminal").click()
    page.keyboard.type("seq 1 200000; echo end\n")

    def at_the_end():
        return shown(page)[-3:] == ["200000", "end", shown_prompt]

    wait_until(at_the_end, timeout=90, interval=0.25, what="the last line and the prompt on screen after 200,000 lines")
    expect(page.locator("#terminal-follow")).to_be_hidden()
    last_row, pane = box(page, "#terminal .xterm-rows > div:last-child"), box(page, "#terminal")
    assert last_row["y"] + last_row["height"] <= pane["y"] + pane["height"], (last_row, pane)  # the prompt whole
    page.screenshot(path=str(shots / "session-page-running-desktop.png"), animations="disabled")

    # Scrolled up by the user: the view stays there, and the button brings it back to the end.
    page.locator("#terminal").hover()
    page.mouse.wheel(0, -2000)
    expect(page.locator("#terminal-follow")).to_be_visible()
    page.click("#terminal-follow")
    expect(page.locator("#terminal-follow")).to_be_hidden()
    wait_until(at_the_end, timeout=10, what="the end again after the button")

    # Phone: the buttons under the title, not over the badge; the terminal first, filling the screen.
    page.set_viewport_size({"width": 390, "height": 844})
    page.reload()
    expect(page.locator("#terminal-status")).to_have_text("Connected")
    badge, terminate = box(page, "#session-status-badge"), box(page, "#terminate-session")
    assert terminate["y"] >= badge["y"] + badge["height"], (terminate, badge)
    terminal = box(page, ".terminal-shell")
    assert terminal["y"] < 400 and terminal["y"] + terminal["height"] >= 800, terminal
    assert box(page, "#usage-panel")["y"] > terminal["y"] + terminal["height"]
    page.screenshot(path=str(shots / "session-page-running-phone.png"), animations="disabled")

    # A batch session: its command, its output as a log; keys go nowhere, the input form's line does.
    page.set_viewport_size({"width": 1440, "height": 900})
    page.goto(console_url + job["terminal_url"])
    expect(page.locator("#session-page")).to_have_attribute("data-kind", "batch")
    expect(page.locator("#session-command")).to_contain_text("read -p 'continue? ' answer")
    expect(page.locator("#terminal-pane-title")).to_have_text("Output")
    wait_until(lambda: "continue?" in "\n".join(terminal_lines(page)), timeout=20, what="the program's question")
    page.locator("#terminal").click()
    page.keyboard.type("typed-into-the-log\n")
    page.fill("#terminal-input-line", "yes")
    page.click("#terminal-input button[type=submit]")
    wait_until(lambda: "you said yes" in "\n".join(terminal_lines(page)), timeout=20, what="the program's answer")
    assert "typed-into-the-log" not in "\n".join(terminal_lines(page))
    page.screenshot(path=str(shots / "session-page-batch-desktop.png"), animations="disabled")

    # Ended (opened afresh): how it ended first, then its log.
    api(console_url, "DELETE", f"/api/v1/sessions/{job['id']}/", token=token)
    wait_until(
        lambda: api(console_url, "GET", f"/api/v1/sessions/{job['id']}/", token=token)["status"] == "TERMINATED",
        timeout=30,
        what="the job TERMINATED",
    )
    page.goto(console_url + job["terminal_url"])
    expect(page.locator("#session-page")).to_have_attribute("data-phase", "ended")
    expect(page.locator("#session-ended-how")).to_have_text("Terminated by you")
    expect(page.locator("#terminal-pane-title")).to_have_text("Log")
    wait_until(lambda: "you said yes" in "\n".join(terminal_lines(page)), timeout=20, what="the log")
    assert box(page, "#session-ended")["y"] < box(page, ".terminal-shell")["y"]
    page.screenshot(path=str(shots / "session-page-ended-desktop.png"), animations="disabled")
    assert page.js_errors == [], page.js_errors
