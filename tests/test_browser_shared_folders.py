"""A shared folder seen from two users in a real browser (issue 36.5), against the console as
`make run` starts it (standalone, demo-node on the process runtime, sessions in bubblewrap).

The admin puts a file in their ~/data from the Files panel and shares the folder read-only with
bob from its Sharing part; bob's new session shows it as shared/admin-data, tagged read-only,
with the file to download and no upload or delete; from bob's terminal a write there fails with
"Read-only file system". Screenshots (session-shared-owner.png, session-shared-recipient.png,
session-shared-terminal.png, session-shared-phone.png) go to $FGPU_SCREENSHOT_DIR, else <repo>/screenshots/."""

from __future__ import annotations

import pytest

from tests.conftest import wait_until
from tests.test_browser import ADMIN_PASSWORD, TIMEOUT_MS, screenshot_dir, terminal_lines
from tests import test_browser, test_browser_workloads
from tests.test_browser_contrast import axe_violations
from tests.test_browser_workloads import BOB_PASSWORD, log_in, new_page, wait_status

pytestmark = pytest.mark.browser
page, browser, console = test_browser.page, test_browser_workloads.browser, test_browser_workloads.console  # fixtures


def open_files(page, base: str, session_id: str) -> None:
    from playwright.sync_api import expect

    page.goto(f"{base}/sessions/{session_id}/terminal/")
    expect(page.locator("#session-status-badge")).to_have_text("RUNNING")
    expect(page.locator("#terminal-status")).to_have_text("Connected")
    page.locator("#files-panel > summary").click()


def test_a_folder_shared_read_only_is_seen_by_both_users_and_written_by_neither_recipient(console, browser):
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    shots = screenshot_dir()
    console.manage(
        f"from django.contrib.auth import get_user_model; get_user_model().objects.create_user('bob', password='{BOB_PASSWORD}')"
    )
    admin, bob = console.api("admin", ADMIN_PASSWORD), console.api("bob", BOB_PASSWORD)
    admins = admin.call("POST", "/api/v1/sessions/", {"name": "owner", "resources": {"cuda.shares": "0.5", "mem": "64M"}})[1]
    wait_status(admin, admins["id"], "RUNNING", timeout=60)

    # The owner: a file into ~/data, then the folder shared read-only with bob.
    owner = new_page(browser)
    log_in(owner, console.url)
    open_files(owner, console.url, admins["id"])
    owner.locator('#files-rows tr[data-name="data"] button.files-open').click()
    owner.set_input_files(
        "#files-upload", files=[{"name": "results.csv", "mimeType": "text/csv", "buffer": b"epoch,loss\n1,0.5\n"}]
    )
    expect(owner.locator('#files-rows tr[data-name="results.csv"]')).to_be_visible()
    expect(owner.locator("#share-folder")).to_have_value("data")
    owner.locator("#share-who").fill("bob")
    owner.locator("#share-permission").select_option("ro")
    owner.locator("#files-share-form button[type=submit]").click()
    share = owner.locator("#files-shares .files-share")
    expect(share.locator(".files-share-text")).to_have_text("data/ shared with bob as shared/admin-data")
    expect(share.locator(".files-tag")).to_have_text("read-only")
    expect(share.locator("button")).to_have_text("Revoke")
    owner.locator("#files-sharing").scroll_into_view_if_needed()
    owner.screenshot(path=str(shots / "session-shared-owner.png"), animations="disabled")
    assert axe_violations(owner, strict=True) == []  # the panel open, its Sharing part and a share listed

    # The recipient: a new session mounts it at ~/shared/admin-data, read-only.
    bobs = bob.call("POST", "/api/v1/sessions/", {"name": "reader", "resources": {"cuda.shares": "0.5", "mem": "64M"}})[1]
    wait_status(bob, bobs["id"], "RUNNING", timeout=60)
    reader = new_page(browser)
    log_in(reader, console.url, "bob", BOB_PASSWORD)
    open_files(reader, console.url, bobs["id"])
    expect(reader.locator("#files-shares .files-share-text")).to_have_text("shared/admin-data from admin")
    expect(reader.locator("#files-shares button")).to_have_text("Leave")
    reader.locator('#files-rows tr[data-name="shared"] button.files-open').click()
    shared = reader.locator('#files-rows tr[data-name="admin-data"]')
    expect(shared.locator(".files-tag")).to_have_text("read-only")
    shared.locator("button.files-open").click()
    row = reader.locator('#files-rows tr[data-name="results.csv"]')
    expect(row.locator("a", has_text="Download")).to_be_visible()
    expect(row.locator("button.files-delete")).to_have_count(0)
    expect(reader.locator("#files-upload")).to_be_disabled()
    reader.screenshot(path=str(shots / "session-shared-recipient.png"), animations="disabled")
    reader.emulate_media(color_scheme="dark")
    assert axe_violations(reader, strict=True) == []  # read-only tags and the disabled upload, dark
    reader.screenshot(path=str(shots / "session-shared-recipient-dark.png"), animations="disabled")
    reader.emulate_media(color_scheme="light")

    reader.locator("#terminal").click()
    reader.keyboard.type("cat ~/shared/admin-data/results.csv; touch ~/shared/admin-data/mine")
    reader.keyboard.press("Enter")
    wait_until(
        lambda: "Read-onlyfilesystem" in "".join(terminal_lines(reader)).replace(" ", ""),  # the path may wrap it
        timeout=30, interval=0.2, what="the terminal saying the shared folder is read-only",
    )  # fmt: skip
    assert any(line.strip() == "1,0.5" for line in terminal_lines(reader))
    reader.screenshot(path=str(shots / "session-shared-terminal.png"), animations="disabled")

    # An empty name is said, not sent; on a phone the Sharing part wraps under the files.
    reader.locator("#files-share-form button[type=submit]").click()
    expect(reader.locator("#share-error")).to_have_text("Name the user to share the folder with.")
    reader.set_viewport_size({"width": 390, "height": 844})
    reader.locator("#files-sharing").scroll_into_view_if_needed()
    reader.screenshot(path=str(shots / "session-shared-phone.png"), animations="disabled")
    assert owner.js_errors == [] and reader.js_errors == [], (owner.js_errors, reader.js_errors)
