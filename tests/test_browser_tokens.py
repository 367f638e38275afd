"""API tokens in a real browser, against the console exactly as `make run` starts it (the
standalone fixture of tests/test_browser.py): log in, open the profile from the user menu,
create a named token, see it once and copy it, call the API with it, revoke it, and see the
API refuse it. The profile with the new token goes to account.png in the screenshot folder, the
revoke confirmation to revoke-dialog.png."""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

from tests.test_browser import ADMIN_PASSWORD, TIMEOUT_MS, console_url, page, screenshot_dir  # noqa: F401 (fixtures)

pytestmark = pytest.mark.browser


def call(url: str, *, token: str = "", body: dict | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a request to the console's API, errors included."""
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Token {token}"
    data = None
    if body is not None:
        headers["Content-Type"] = "application/json"
        data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_user_creates_a_named_token_sees_it_once_uses_it_and_revokes_it(console_url, page):  # noqa: F811
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=console_url)
    sessions_api = console_url + "/api/v1/sessions/"

    # `fgpu login` still gets its token from the password endpoint; the profile lists it.
    status, body = call(console_url + "/api/v1/auth/token/", body={"username": "admin", "password": ADMIN_PASSWORD})
    assert status == 200 and set(body) == {"token"}, body
    login_token = body["token"]

    page.goto(console_url + "/login/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", ADMIN_PASSWORD)
    page.click("#login-submit")
    expect(page).to_have_url(console_url + "/sessions/")

    # The user menu leads to the profile.
    page.click("#profile-link")
    expect(page).to_have_url(console_url + "/account/")
    expect(page.locator("h1")).to_have_text("Profile")
    expect(page.locator("#account-role")).to_have_text("Administrator")
    expect(page.locator("tr[data-login-token]")).to_contain_text(login_token[:8] + "…")

    for name in ("laptop", "ci-pipeline"):
        page.fill("#token-name", name)
        page.click("#create-token")
        expect(page.locator("#new-token")).to_be_visible()
        expect(page.locator("#new-token-name")).to_have_text(name)
    key = page.locator("#new-token-value").input_value()
    assert re.fullmatch(r"[A-Za-z0-9_-]{43}", key), key
    row = page.locator("#tokens-table tbody tr", has_text="ci-pipeline")
    expect(row).to_contain_text(key[:8] + "…")
    expect(row.locator(".last-used")).to_have_text("Never")

    page.click("#copy-token")
    expect(page.locator("#copy-token")).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == key
    page.mouse.move(0, 0)
    page.screenshot(path=str(screenshot_dir() / "account.png"), full_page=True, animations="disabled")

    # The token works against the API as its user.
    status, body = call(sessions_api, token=key)
    assert status == 200, body
    assert "results" in body

    # Shown once, and the page that showed it was a GET (POST-redirect-GET): its reload re-posts
    # nothing (Playwright would otherwise answer the browser's "resubmit?" itself) and shows the
    # prefix, not the token, and now a last use.
    expect(page).to_have_url(console_url + "/account/")
    page.reload()
    expect(page.locator("#tokens-table tbody tr", has_text="ci-pipeline")).to_have_count(1)
    expect(page.locator("#new-token")).to_have_count(0)
    assert key not in page.content()
    expect(row).to_contain_text(key[:8] + "…")
    expect(row.locator(".last-used")).to_have_text("just now")

    # Revoke asks first; "Keep it" keeps it.
    row.locator(".revoke-button").click()
    dialog = page.locator("#revoke-dialog")
    expect(dialog).to_be_visible()
    expect(page.locator("#revoke-name")).to_have_text("ci-pipeline")
    page.screenshot(path=str(screenshot_dir() / "revoke-dialog.png"), animations="disabled")
    page.click("#revoke-cancel")
    expect(dialog).to_be_hidden()
    assert call(sessions_api, token=key)[0] == 200

    row.locator(".revoke-button").click()
    page.click("#revoke-confirm")
    expect(page).to_have_url(console_url + "/account/")
    expect(page.locator(".message-success")).to_contain_text("“ci-pipeline”")
    expect(row).to_have_count(0)
    expect(page.locator("#tokens-table tbody tr", has_text="laptop")).to_have_count(1)

    status, body = call(sessions_api, token=key)
    assert status == 401, body
    assert set(body) == {"type", "title", "detail", "field_errors"}
    assert call(sessions_api, token=login_token)[0] == 200  # the other tokens still work

    assert page.js_errors == []
