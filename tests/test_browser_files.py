"""The session page's file panel in a real browser (issue 18), against the console as `make run`
starts it (tests/test_browser.py: standalone, demo-node on the process runtime).

A file uploaded in the panel (with its progress bar) is seen by `ls` in the session's terminal
and downloads back byte-identical; one uploaded into `data/` lands in the user's persistent
folder; a delete asks first, then the row goes. Screenshots go to $FGPU_SCREENSHOT_DIR, else
<repo>/screenshots/."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.test_browser import ADMIN_PASSWORD, TIMEOUT_MS, screenshot_dir, terminal_lines
from tests.test_browser import console_url, page  # noqa: F401  (fixtures)
from tests.test_browser_session_apps import call
from tests.test_browser_workloads import log_in

pytestmark = pytest.mark.browser


def test_a_file_uploaded_in_the_panel_is_seen_by_ls_in_the_terminal_and_downloads_back_byte_identical(
        console_url, page, tmp_path):
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    base = console_url
    token = call(base, "POST", "/api/v1/auth/token/", {"username": "admin", "password": ADMIN_PASSWORD})[0]["token"]
    session = call(base, "POST", "/api/v1/sessions/", {"name": "files", "resources": {"cuda.shares": "0.5"}}, token)[0]
    payload = os.urandom(700 * 1024 + 3)  # three chunks on the way to the agent

    log_in(page, base)
    page.goto(f"{base}/sessions/{session['id']}/terminal/")
    expect(page.locator("#session-status-badge")).to_have_text("RUNNING")
    expect(page.locator("#terminal-status")).to_have_text("Connected")
    page.locator("#files-panel > summary").click()
    data_row = page.locator('#files-rows tr[data-name="data"]')
    expect(data_row.locator(".files-tag")).to_have_text("persistent")

    page.set_input_files("#files-upload", files=[{"name": "payload.bin", "mimeType": "application/octet-stream",
                                                  "buffer": payload}])
    row = page.locator('#files-rows tr[data-name="payload.bin"]')
    expect(row.locator("td.num")).to_have_text("700 KiB")
    expect(page.locator("#files-uploads .files-upload.is-done .files-upload-pct")).to_have_text("done")
    page.screenshot(path=str(screenshot_dir() / "session-files-panel.png"), animations="disabled")

    page.locator("#terminal").click()
    page.keyboard.type("ls -l payload.bin")
    page.keyboard.press("Enter")
    wait_until(lambda: any(re.search(rf"\b{len(payload)}\b.*payload\.bin$", line) for line in terminal_lines(page)),
               timeout=30, interval=0.2, what="`ls -l payload.bin` in the terminal showing the file and its size")
    page.screenshot(path=str(screenshot_dir() / "session-files-ls.png"), animations="disabled")

    with page.expect_download() as downloading:
        row.locator("a", has_text="Download").click()
    assert Path(downloading.value.path()).read_bytes() == payload
    assert downloading.value.suggested_filename == "payload.bin"

    data_row.locator("button.files-open").click()
    expect(page.locator('#files-crumbs [aria-current="location"]')).to_have_text("data")
    page.set_input_files("#files-upload", files=[{"name": "kept.txt", "mimeType": "text/plain", "buffer": b"kept"}])
    expect(page.locator('#files-rows tr[data-name="kept.txt"]')).to_be_visible()
    kept = list((tmp_path / "data" / "user-data" / "users").glob("*/kept.txt"))
    assert [p.read_bytes() for p in kept] == [b"kept"]

    page.locator("#files-crumbs button", has_text="Home").click()
    row.locator("button.files-delete").click()
    expect(page.locator("#file-delete-dialog")).to_be_visible()
    expect(page.locator("#file-delete-name")).to_have_text("payload.bin")
    page.screenshot(path=str(screenshot_dir() / "session-files-delete.png"), animations="disabled")
    page.locator("#file-delete-confirm").click()
    expect(row).to_have_count(0)
    expect(page.locator("#files-error")).to_be_hidden()

    page.set_viewport_size({"width": 390, "height": 844})
    page.screenshot(path=str(screenshot_dir() / "session-files-phone.png"), animations="disabled", full_page=True)
    assert page.js_errors == [], page.js_errors
