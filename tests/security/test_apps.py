"""A page a session's app serves cannot use the console (issue 31.4, "Done when": a page served
by a user's app cannot run script with console cookies; app tokens cannot be computed).

Against the console as `make run` starts it (standalone, apps on PORT + 1, their own origin), in
headless Chromium: an administrator signed in to the console opens a user's app (tests/apps/
echo_app.py, standing in for a page the user wrote); script on that page then tries what such a
page would: read the console's cookies, call the console's API and websockets with the
administrator's credentials, frame the console. Each attack FAILS the test if it succeeds.
Screenshots go to $FGPU_SCREENSHOT_DIR, else <repo>/screenshots/."""
from __future__ import annotations

import pytest

from tests.test_app_origin import ADMIN_PASSWORD, api, apps_console, open_app  # noqa: F401  (fixture)
from tests.test_browser import page, screenshot_dir  # noqa: F401  (fixture)

pytestmark = pytest.mark.browser

ATTACK = """async (console) => {
  const seen = {cookie: document.cookie, origin: location.origin};
  try {
    const r = await fetch(console + "/api/v1/me/", {credentials: "include"});
    seen.me = {status: r.status, body: await r.text()};
  } catch (e) { seen.me = {error: String(e)}; }
  try {
    const r = await fetch(console + "/api/v1/me/", {credentials: "include", mode: "no-cors"});
    seen.opaque = {type: r.type, status: r.status, body: await r.text()};
  } catch (e) { seen.opaque = {error: String(e)}; }
  seen.ws = await new Promise((resolve) => {
    const ws = new WebSocket(console.replace("http", "ws") + "/ws/sessions/");
    const done = (what) => { try { ws.close(); } catch (e) {} resolve(what); };
    ws.onmessage = (m) => done("message: " + m.data);
    ws.onopen = () => setTimeout(() => done("open"), 500);
    ws.onclose = (e) => done("closed " + e.code);
    ws.onerror = () => done("error");
  });
  seen.frame = await new Promise((resolve) => {
    const frame = document.createElement("iframe");
    frame.src = console + "/sessions/";
    frame.onload = () => {
      try { resolve("read: " + frame.contentDocument.body.innerText.slice(0, 200)); }
      catch (e) { resolve("unreadable"); }
    };
    document.body.appendChild(frame);
    setTimeout(() => resolve("no load"), 5000);
  });
  return seen;
}"""


def test_a_page_served_by_an_app_gets_no_console_cookie_api_or_websocket(apps_console, page):  # noqa: F811
    from playwright.sync_api import expect

    from tests.test_browser_workloads import log_in

    base, apps, token, session_id = apps_console
    open_app(base, token, session_id, "echo")
    log_in(page, base, password=ADMIN_PASSWORD)
    console_cookies = {c["name"] for c in page.context.cookies(base)}
    assert "sessionid" in console_cookies  # the administrator is signed in to the console

    # The console's link leads to the apps origin (through the ticket), never the console's origin.
    page.goto(f"{base}/sessions/{session_id}/apps/echo/echo")
    expect(page).to_have_url(f"{apps}/sessions/{session_id}/apps/echo/echo")
    assert '"authorized": true' in page.content()
    seen = page.evaluate(ATTACK, base)
    page.screenshot(path=str(screenshot_dir() / "security-app-origin.png"), animations="disabled")

    assert seen["origin"] == apps
    for name in ("sessionid", "csrftoken", "fgpu_app"):
        assert f"{name}=" not in seen["cookie"], seen  # nothing of the console (nor the app's own sign-in) readable
    assert "username" not in seen["me"].get("body", ""), seen["me"]  # the API did not answer it
    assert seen["opaque"].get("body", "") == "" and seen["opaque"].get("status", 0) == 0, seen["opaque"]
    assert not seen["ws"].startswith(("open", "message")), seen["ws"]  # no live notices of the console's
    assert not seen["frame"].startswith("read:"), seen["frame"]

    # The console itself still answers the administrator, and refuses the app's origin.
    me = api(base, "GET", "/api/v1/me/", token)
    assert me.status_code == 200
    assert api(base, "GET", "/api/v1/me/", token, headers={"Origin": apps}).status_code == 403


def test_a_users_app_token_cannot_be_computed_from_the_secret_key(apps_console, procs):  # noqa: F811
    """The old token was HMAC-SHA256(SECRET_KEY, "fgpu-app:<session>:<app>")[:48]; with the public
    default key a user computed another's and used his app directly. Here the attacker reaches the
    app's own port (on the node's loopback, process runtime: as a session there could) with that
    token, and with the key of the console's settings: the app must refuse both."""
    import hashlib
    import hmac
    import re

    import httpx
    from django.conf import settings

    from tests.conftest import wait_until

    base, apps, token, session_id = apps_console
    open_app(base, token, session_id, "echo")
    server = procs[-1]
    started = wait_until(lambda: re.search(rf"started app echo of session {session_id} on ([0-9.]+):(\d+)", server.output()),
                         timeout=30, what="the agent to say where the app listens")
    direct = f"http://{started.group(1)}:{started.group(2)}/sessions/{session_id}/apps/echo/echo"
    for key in ("dev-only-insecure-key-set-FGPU_SECRET_KEY-in-production", settings.SECRET_KEY):
        guessed = hmac.new(key.encode(), f"fgpu-app:{session_id}:echo".encode(), hashlib.sha256).hexdigest()[:48]
        answer = httpx.get(direct, headers={"Authorization": f"token {guessed}"}, timeout=30)
        assert answer.status_code == 403 and "authorized" not in answer.text, key  # the app refused the computed token
