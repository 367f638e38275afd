""""My resources" and the launch dialog's caps in a real browser (issue 18.1), against the
standalone console (tests/test_browser_workloads.py's `console`): a user with a quota of 2
sessions and 1.00 fGPU sees what they hold against it, the free capacity by resource group,
where the slider's cap comes from, a slider past what is free now that says it will wait, and —
at their quota — the preview refusing before Launch, with Launch off. Desktop and 390×844
screenshots."""
from __future__ import annotations

import pytest

from tests.test_browser import ADMIN_PASSWORD, TIMEOUT_MS, screenshot_dir
from tests.test_browser import page  # noqa: F401  (fixture)
from tests.test_browser_workloads import (  # noqa: F401  (fixtures)
    BOB_PASSWORD,
    DESKTOP,
    PHONE,
    browser,
    console,
    log_in,
    new_page,
    overlaps,
    wait_status,
)

pytestmark = pytest.mark.browser


def open_dialog(page):
    from playwright.sync_api import expect

    page.click("#start-session")
    expect(page.locator("#launch-dialog")).to_be_visible()
    expect(page.locator("#options-status")).to_have_text("")
    return page.locator("#launch-dialog")


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
def test_a_user_at_quota_sees_it_in_my_resources_and_the_preview_refuses_before_launch(console, browser, viewport):
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    shots, size = screenshot_dir(), "desktop" if viewport == DESKTOP else "phone"
    console.manage("from django.contrib.auth import get_user_model; from decimal import Decimal; "
                   "from sessions.models import Quota; "
                   f"bob = get_user_model().objects.create_user('bob', password='{BOB_PASSWORD}'); "
                   "Quota.objects.create(user=bob, max_sessions=2, max_fgpu=Decimal('1.00'))")
    bob = console.api("bob", BOB_PASSWORD)
    first = bob.call("POST", "/api/v1/sessions/", {"resources": {"cuda.shares": "0.5", "mem": "64M"}})[1]
    wait_status(bob, first["id"], "RUNNING")

    page = new_page(browser, viewport)
    log_in(page, console.url, "bob", BOB_PASSWORD)
    panel = page.locator("#my-resources")
    expect(panel.locator('[data-key="fgpu"] .resources-value')).to_have_text("0.50 fGPU of 1.00 fGPU")
    expect(panel.locator('[data-key="sessions"] .resources-value')).to_have_text("1 of 2")
    expect(panel.locator('[data-key="fgpu"] .resources-source')).to_have_text("0.50 fGPU left · capped by your quota")
    expect(panel.locator('[data-key="gpu_memory"] .resources-value')).to_have_text("2 GiB · no quota")
    expect(panel.locator("#resources-groups tbody tr").first).to_contain_text("Any node")
    page.screenshot(path=str(shots / f"my-resources-panel-{size}.png"))

    # The dialog: the slider's cap says where it comes from; asking past what is free now waits.
    dialog = open_dialog(page)
    expect(dialog.locator("#fgpu-capacity")).to_contain_text("capped by your quota: 0.50 fGPU")
    expect(dialog.locator("#fgpu-slider")).to_have_attribute("max", "0.50")
    expect(dialog.locator("#launch-preview")).to_have_attribute("data-state", "now")
    expect(dialog.locator("#launch-submit")).to_be_enabled()
    # More than is free now is offered too, and says it will wait (the slider reaches 0.50 only:
    # what is free now is more than the quota allows, so the note stays hidden here).
    expect(dialog.locator("#capacity-note")).to_be_hidden()
    page.screenshot(path=str(shots / f"my-resources-dialog-{size}.png"), full_page=True)
    dialog.get_by_role("button", name="Cancel").click()

    # A second session: bob is at 2 of 2.
    bob.call("POST", "/api/v1/sessions/", {"resources": {"cuda.shares": "0.25", "mem": "64M"}})
    expect(panel.locator('[data-key="sessions"] .resources-value')).to_have_text("2 of 2")  # live, no reload
    expect(panel.locator('[data-key="sessions"] .resources-source')).to_have_text("none left · capped by your quota")

    # At quota: the preview refuses before Launch, and Launch is off with the reason beside it.
    dialog = open_dialog(page)
    expect(dialog.locator("#launch-preview")).to_have_attribute("data-state", "never")
    expect(dialog.locator("#preview-line")).to_contain_text(
        "would be refused: your quota: 2 sessions running or waiting, at most 2")
    expect(dialog.locator("#launch-submit")).to_be_disabled()
    expect(dialog.locator("#launch-submit")).to_have_attribute("aria-describedby", "preview-line")
    expect(dialog.locator("#fgpu-capacity")).to_contain_text("your quota allows none now (no session left)")
    expect(dialog.locator("#launch-submit")).to_be_disabled()  # still, after the free capacity was read again
    page.screenshot(path=str(shots / f"my-resources-at-quota-{size}.png"), full_page=True)
    if viewport == PHONE:
        assert overlaps(page, "#my-resources .resources-figure, #my-resources tr") == []
    assert page.js_errors == []


def test_the_slider_reaches_the_largest_node_and_more_than_is_free_now_says_it_will_wait(console, browser):
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    admin = console.api("admin", ADMIN_PASSWORD)
    [slot] = [s for s in admin.call("GET", "/api/v1/launch-options/")[1]["slots"] if s["slot"] == "cuda.shares"]
    largest = slot["max_ever"]
    filler = admin.call("POST", "/api/v1/sessions/", {"resources": {"cuda.shares": largest, "mem": "64M"}})[1]
    wait_status(admin, filler["id"], "RUNNING")  # the largest node is full: less is free now than it holds

    page = new_page(browser)
    log_in(page, console.url)
    dialog = open_dialog(page)
    slider = dialog.locator("#fgpu-slider")
    expect(slider).to_have_attribute("max", largest)
    expect(dialog.locator("#capacity-note")).to_be_hidden()
    slider.fill(largest)
    expect(dialog.locator("#capacity-note")).to_be_visible()
    expect(dialog.locator("#capacity-note")).to_contain_text("free now: the session will wait in the queue until it fits")
    expect(dialog.locator("#launch-preview")).to_have_attribute("data-state", "wait")
    expect(dialog.locator("#launch-submit")).to_be_enabled()  # it may wait; it is not refused
    page.screenshot(path=str(screenshot_dir() / "my-resources-will-wait-desktop.png"), full_page=True)
    assert page.js_errors == []
