"""The launch dialog's image picker in a real browser, against the console as `make run` starts it
(tests/test_browser.py: standalone, demo-node on the process runtime, which holds only "host").

An administrator registers a second image through the API; the user's dialog lists both with the
default ("host") selected and says where each is; picking the other one, the preview says the
session would wait for a node with it, and the launch sends it and shows the reason.
A screenshot of the dialog goes to $FGPU_SCREENSHOT_DIR, else <repo>/screenshots/."""
from __future__ import annotations

import json
import urllib.request

import pytest

from tests.test_browser import ADMIN_PASSWORD, screenshot_dir
from tests.test_browser import console_url, page  # noqa: F401  (fixtures)
from tests.test_browser_launch_styles import log_in_and_open_the_dialog

pytestmark = pytest.mark.browser

TEST_IMAGE = "fgpu-session:test"


def api_post(base: str, path: str, body: dict, token: str | None = None) -> dict:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Token {token}"
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def test_the_image_picker_offers_the_registered_images_with_the_default_selected(console_url, page):
    from playwright.sync_api import expect

    token = api_post(console_url, "/api/v1/auth/token/", {"username": "admin", "password": ADMIN_PASSWORD})["token"]
    api_post(console_url, "/api/v1/images/", {"reference": TEST_IMAGE, "display_name": "Debian minimal",
                                              "description": "bash, python3, procps"}, token)

    dialog = log_in_and_open_the_dialog(page, console_url)
    picker = page.locator("#image-select")
    expect(picker).to_have_value("host")
    expect(picker.locator("option")).to_have_text(["Host (no container) · host (default)",
                                                    f"Debian minimal · {TEST_IMAGE}"])
    expect(page.locator("#image-hint")).to_contain_text("without a container: the process runtime runs each session in its own sandbox")
    expect(page.locator("#image-hint")).to_contain_text("read-only. On demo-node.")
    expect(page.locator("#preview-line")).to_have_text("starts now on demo-node")
    dialog.screenshot(path=str(screenshot_dir() / "launch-image-picker.png"), animations="disabled")

    picker.select_option(TEST_IMAGE)
    expect(page.locator("#image-hint")).to_have_text("bash, python3, procps. No node has it now: a session in it "
                                                     "waits until one does.")
    expect(page.locator("#preview-line")).to_have_text(
        f"will wait: waiting for a node with image {TEST_IMAGE}: no node has it")
    dialog.screenshot(path=str(screenshot_dir() / "launch-image-picker-waiting.png"), animations="disabled")

    with page.expect_response(lambda r: r.url.endswith("/api/v1/sessions/") and r.request.method == "POST") as info:
        page.click("#launch-submit")
    created = info.value.json()
    assert info.value.status == 201, created
    assert info.value.request.post_data_json["image"] == TEST_IMAGE
    assert created["image"] == TEST_IMAGE
    row = page.locator(f'#sessions-table tr[data-session-id="{created["id"]}"]')
    expect(row.locator("td.status")).to_have_text("PENDING")
    expect(row.locator("td.status")).to_have_attribute("data-reason", f"waiting for a node with image {TEST_IMAGE}: "
                                                                      "no node has it")
    assert page.js_errors == [], page.js_errors


def test_a_launch_answer_that_arrives_after_the_passs_notice_does_not_put_the_older_reason_back(console_url, page):
    """The pass's notice ("waiting for a node with image …", a newer version) can reach the page
    before the launch's own answer, read before the pass ("waiting for the scheduler", version
    0), as on a loaded machine: here the answer is held until the notice has drawn the row, and
    then sent as the session was when it was created."""
    from playwright.sync_api import expect

    token = api_post(console_url, "/api/v1/auth/token/", {"username": "admin", "password": ADMIN_PASSWORD})["token"]
    api_post(console_url, "/api/v1/images/", {"reference": TEST_IMAGE, "display_name": "Debian minimal"}, token)
    held = []

    def hold(route):
        if route.request.method != "POST":
            route.continue_()
            return
        held.append((route, route.fetch()))  # the session is created now; its answer waits

    dialog = log_in_and_open_the_dialog(page, console_url)
    page.route("**/api/v1/sessions/", hold)
    page.locator("#image-select").select_option(TEST_IMAGE)
    expect(page.locator("#preview-line")).to_have_text(
        f"will wait: waiting for a node with image {TEST_IMAGE}: no node has it")
    page.click("#launch-submit")
    waiting = f"waiting for a node with image {TEST_IMAGE}: no node has it"
    row = page.locator("#sessions-table tr[data-session-id]").first
    expect(row.locator("td.status")).to_have_attribute("data-reason", waiting)  # the notice drew it
    assert len(held) == 1
    route, response = held[0]
    answer = response.json()
    # The answer is the launch's own shape (the one its notice rendered, before the pass): older
    # than what the pass's notice drew, whatever version it holds; it is sent as created below.
    assert answer["status"] == "PENDING", answer
    assert row.get_attribute("data-session-id") == answer["id"]

    created = {**answer, "status_reason": "waiting for the scheduler", "version": 0}
    route.fulfill(response=response, json=created)
    expect(dialog).to_be_hidden()  # the answer was taken
    expect(row.locator("td.status")).to_have_attribute("data-reason", waiting)
    assert page.locator(f'#sessions-table tr[data-session-id="{answer["id"]}"]').count() == 1
    assert page.js_errors == [], page.js_errors
