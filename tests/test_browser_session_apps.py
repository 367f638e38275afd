"""Session apps in a real browser (issue 16), against the console as `make run` starts it
(tests/test_browser.py: standalone, demo-node on the process runtime, image "host").

An administrator declares two apps on "host" through the API: `echo` (tests/apps/echo_app.py, a
real ASGI app whose page opens a websocket back to itself, which the session's user uploads into
the session's home through the files API, as a sandboxed session sees no folder of this checkout)
and `broken` (exits at once). The session
list and the session page show them beside Terminal; clicking Echo opens a new tab that starts it
and then shows the app's page on the apps origin (make run's port + 1, through a one-time ticket), whose websocket answers through the proxy; Broken's tab says it
exited, with its output; once the session ends, the app's tab says so on reload.
Screenshots go to $FGPU_SCREENSHOT_DIR, else <repo>/screenshots/."""
from __future__ import annotations

import json
import sys
import urllib.request
from urllib.parse import urlsplit

import pytest

from tests.conftest import ROOT
from tests.test_browser import ADMIN_PASSWORD, screenshot_dir
from tests.test_browser import console_url, page  # noqa: F401  (fixtures)
from tests.test_browser_workloads import log_in

pytestmark = pytest.mark.browser

ECHO = (f'PYTHONPATH="$HOME/apps" exec {sys.executable} -m daphne -b {{host}} -p {{port}} '
        "echo_app:application")  # the agent's Python (and its daphne) is what a sandbox shows read-only
APPS = [{"name": "echo", "title": "Echo", "command": ECHO, "port": 8080, "base_url": True, "timeout": 60},
        {"name": "broken", "title": "Broken", "command": "echo 'broken: no such notebook'; exit 4", "port": 8082}]


def call(base: str, method: str, path: str, body: dict | None = None, token: str | None = None,
         headers: dict | None = None):
    request = urllib.request.Request(base + path, data=json.dumps(body).encode() if body is not None else None,
                                     method=method, headers={"Content-Type": "application/json", **(headers or {}),
                                                             **({"Authorization": f"Token {token}"} if token else {})})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read() or b"null"), response.headers


def test_apps_open_from_the_session_list_in_a_new_tab_and_say_when_they_closed(console_url, page):
    from playwright.sync_api import expect

    base = console_url
    token = call(base, "POST", "/api/v1/auth/token/", {"username": "admin", "password": ADMIN_PASSWORD})[0]["token"]
    host = next(i for i in call(base, "GET", "/api/v1/images/", token=token)[0]["results"] if i["reference"] == "host")
    _, headers = call(base, "GET", f"/api/v1/images/{host['id']}/", token=token)
    call(base, "PATCH", f"/api/v1/images/{host['id']}/", {"apps": APPS}, token, headers={"If-Match": headers["ETag"]})
    session = call(base, "POST", "/api/v1/sessions/", {"name": "notebook", "resources": {"cuda.shares": "0.5"}},
                   token)[0]

    log_in(page, base)
    row = page.locator(f'#sessions-table tr[data-session-id="{session["id"]}"]')
    expect(row.locator("td.status")).to_have_text("RUNNING")
    upload = urllib.request.Request(f"{base}/api/v1/sessions/{session['id']}/files/content/?path=apps/echo_app.py",
                                    data=(ROOT / "tests" / "apps" / "echo_app.py").read_bytes(), method="PUT",
                                    headers={"Authorization": f"Token {token}", "Content-Type": "application/octet-stream"})
    with urllib.request.urlopen(upload, timeout=30) as response:
        assert response.status in (200, 201), response.read()
    expect(row.locator("a.app-link")).to_have_text(["Echo", "Broken"])
    page.screenshot(path=str(screenshot_dir() / "session-apps-list.png"), animations="disabled")

    with page.context.expect_page() as opened:
        row.locator('a.app-link[data-app="echo"]').click()
    app = opened.value
    apps = f"http://localhost:{urlsplit(base).port + 1}"  # make run's apps origin: localhost, its port + 1
    expect(app).to_have_url(f"{apps}/sessions/{session['id']}/apps/echo/", timeout=60_000)  # there, not the console's
    expect(app.locator("h1")).to_have_text("hello from echo_app")
    expect(app.locator("#ws")).to_have_text("websocket says: echo:hi")
    app.screenshot(path=str(screenshot_dir() / "session-apps-echo.png"), animations="disabled")

    with page.context.expect_page() as opened:
        row.locator('a.app-link[data-app="broken"]').click()
    broken = opened.value
    expect(broken.locator("#app-open-state")).to_have_text("App failed to start", timeout=60_000)
    expect(broken.locator("#app-open-detail")).to_contain_text("broken exited with code 4 before it answered")
    expect(broken.locator("#app-open-output")).to_have_text("broken: no such notebook")
    broken.screenshot(path=str(screenshot_dir() / "session-apps-failed.png"), animations="disabled")

    page.goto(f"{base}/sessions/{session['id']}/terminal/")
    expect(page.locator("#session-apps a.app-link")).to_have_text(["Echo", "Broken"])
    page.screenshot(path=str(screenshot_dir() / "session-apps-terminal-page.png"), animations="disabled")

    call(base, "DELETE", f"/api/v1/sessions/{session['id']}/", token=token)
    expect(page.locator("#session-status-badge")).to_have_text("TERMINATED", timeout=60_000)
    expect(page.locator("#session-apps")).to_be_hidden()
    expect(app.locator("#ws")).to_contain_text("(closed")  # its websocket ended with the session
    app.reload()
    expect(app.locator("h1")).to_have_text("Session ended")
    expect(app.locator(".app-open-state")).to_have_text("The session is TERMINATED: its apps ended with it.")
    app.screenshot(path=str(screenshot_dir() / "session-apps-session-ended.png"), animations="disabled")
    assert page.js_errors == [], page.js_errors
